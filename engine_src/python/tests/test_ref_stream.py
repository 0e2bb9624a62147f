import multiprocessing

import numpy as np
import pytest
from test_ref_kdtr import INT4, make_tensors

from kdtree_ref import kdtr, stream


def write_share(path, plan, tensors, worker, workers):
    """Worker `worker` of `workers`: every workers-th tensor, a whole one, one in row blocks, or
    (the head) row ranges that the other workers also write, whose hash the last worker reads back."""
    digests = {}
    with stream.Part(path, plan) as part:
        for i, (name, array) in enumerate(tensors.items()):
            if name == "head":
                rows = np.array_split(np.arange(array.shape[0]), workers)[worker]
                part.write_rows(name, int(rows[0]), array[rows])
            elif i % workers == worker and i % 2:
                sink = part.rows(name)
                for block in np.array_split(array, 3):
                    sink.write(block)
                digests[name] = sink.close()
            elif i % workers == worker:
                digests[name] = part.write(name, array)
    return digests


def test_four_processes_write_the_bytes_of_the_in_memory_writer(tmp_path):
    tensors = make_tensors(INT4, seed=3)
    plan = kdtr.plan(INT4, kdtr.specs_of(tensors))
    path = tmp_path / "streamed.kdtr"
    stream.create(path, plan)
    assert path.stat().st_blocks * 512 < plan.size  # sparse: the data is not there yet
    with pytest.raises(kdtr.KdtrError, match="bad index magic"):
        kdtr.read(path)  # an unfinished bundle is refused
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        parts = pool.starmap(write_share, [(path, plan, tensors, w, 4) for w in range(4)])
    digests = {k: v for part in parts for k, v in part.items()}
    with stream.Part(path, plan) as part:
        digests["head"] = part.hash("head")
    identity = stream.finish(path, plan, digests)
    expected = kdtr.encode(INT4, tensors, version=2)
    assert path.read_bytes() == expected
    assert identity == expected[-32:].hex() == kdtr.read(path).identity()


def test_stream_refuses_misuse(tmp_path):
    tensors = make_tensors(INT4)
    plan = kdtr.plan(INT4, kdtr.specs_of(tensors))
    path = tmp_path / "b.kdtr"
    stream.create(path, plan)
    with stream.Part(path, plan) as part:
        with pytest.raises(ValueError, match="expected f32"):
            part.write("embed", tensors["embed"].astype(np.int32))
        sink = part.rows("embed")
        sink.write(tensors["embed"][:3])
        with pytest.raises(ValueError, match="of its 2048 bytes written"):
            sink.close()
        with pytest.raises(ValueError, match="outside its 16 rows"):
            part.write_rows("head", 15, tensors["head"][:2])
    with pytest.raises(ValueError, match="missing"):
        stream.finish(path, plan, {})
    path.write_bytes(b"")
    with pytest.raises(kdtr.KdtrError, match="not created by stream.create"):
        stream.Part(path, plan)
