// cli.h: the subcommands of the kdtree binary (cli_main.cpp dispatches to them).
#pragma once

#include <cstdint>
#include <string>

namespace kd {

class Args;
struct Bundle;

constexpr int kMaxTokens = 1 << 24;   // -n, and any token list a flag gives
// --budget, --budgets: DDTree's speed-up peaks at 256-512 nodes; a verify pass costs time linear
// in the budget, so a larger tree only slows a run down.
constexpr int kMaxBudget = 1024;

// The whole command line (main's argc/argv): runs the command, returns the exit status. Errors
// go to stderr as "kdtree <command>: error: <message>" with status 1; usage errors return 2.
int cli_main(int argc, char** argv);

int cmd_generate(int argc, char** argv);  // kdtree generate --bundle F ...
int cmd_check(int argc, char** argv);     // kdtree check --bundle F --expect golden|ar|1,2,3 ...
int cmd_outputs(int argc, char** argv);   // kdtree outputs --manifest M --out F ...
int cmd_bench(int argc, char** argv);     // kdtree bench --manifest M --out F ...
int cmd_verify(int argc, char** argv);    // kdtree verify --bundle F ...

// --max-memory (README.md, "Input validation"): what a bundle may ask for, default 4 GiB.
uint64_t max_memory_flag(const Args& a);
// --backend: "cpu" or "cuda", default the build's backend.
std::string backend_flag(const Args& a);

// A bundle's load phases as `verify` and `bench` print them: "read in 0.412 s (0.79 GB/s, 2
// threads), checked in 1.203 s (0.27 GB/s, 2 hardware threads)", then ", uploaded to <backend> in
// 0.300 s (1.08 GB/s of weights)" when upload_seconds is not negative.
std::string load_phases(const Bundle& b, const std::string& backend, double upload_seconds);

}  // namespace kd
