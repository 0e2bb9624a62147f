// main.cpp: the kdtree binary (the command line lives in cli_main.cpp, which the fuzz harness
// calls too).
#include "cli.h"

int main(int argc, char** argv) { return kd::cli_main(argc, argv); }
