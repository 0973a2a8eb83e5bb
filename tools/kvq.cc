// The `kvq` command-line program.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "CLI/CLI.hpp"
#include "kvq/error.h"
#include "kvq/targets.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvq: KV-cache quantization for transformer inference"};
  app.require_subcommand(1);
  kvq::tools::DemoOptions demo;
  kvq::tools::AddDemoCommand(app, demo);
  kvq::tools::EvalCliOptions eval;
  kvq::tools::AddEvalCommand(app, eval);
  kvq::tools::ReceiptsCliOptions receipts;
  kvq::tools::AddReceiptsCommand(app, receipts);
  kvq::tools::GenerateOptions gen;
  kvq::tools::AddGenerateCommand(app, gen);
  kvq::tools::ServeCliOptions serve;
  kvq::tools::AddServeCommand(app, serve);
  kvq::tools::ChatTemplateCliOptions chat;
  kvq::tools::AddChatTemplateCommand(app, chat);
  std::string command_line;
  for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
  eval.command_line = receipts.command_line = command_line;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "kvq: error: %s (see --help)\n", e.what());  // the CLI contract: one line, exit 2
    return 2;
  }
  try {
    kvq::apply_simd_targets_from_env();
    if (app.got_subcommand("demo")) return kvq::tools::RunDemo(demo);
    if (app.got_subcommand("eval")) return kvq::tools::RunEval(eval);
    if (app.got_subcommand("receipts")) return kvq::tools::RunReceipts(receipts);
    if (app.got_subcommand("generate")) return kvq::tools::RunGenerate(gen);
    if (app.got_subcommand("serve")) return kvq::tools::RunServe(serve);
    if (app.got_subcommand("chat-template")) return kvq::tools::RunChatTemplate(chat);
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
