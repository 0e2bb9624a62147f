"""NumPy reference of the kdtree engine: model, INT4 quantizer, KDTR bundles, drafter, DDTree."""
