// Subcommands of the `kvq` program. Each returns the process exit code:
// 0 success, 2 bad input (a kvq::Error), 1 anything else.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace kvq::tools {

struct DemoOptions {
  int tokens = 4096;
  int heads = 32;
  int head_dim = 128;
  int threads = 0;  // 0: OpenMP default
};
void AddDemoCommand(CLI::App& app, DemoOptions& opts);
int RunDemo(const DemoOptions& opts);

}  // namespace kvq::tools
