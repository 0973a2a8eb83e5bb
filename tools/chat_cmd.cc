// `kvq chat-template`: a conversation rendered into the prompt text by a
// model's chat template (model/chat_template.h), as kvq serve's
// /v1/chat/completions renders it.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "kvq/error.h"
#include "kvq/file.h"
#include "model/chat_template.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/commands.h"

namespace kvq::tools {

void AddChatTemplateCommand(CLI::App& app, ChatTemplateCliOptions& o) {
  CLI::App* c = app.add_subcommand(
      "chat-template", "Render a conversation into the prompt a chat template makes of it (kvq serve's chat route)");
  c->add_option("--model", o.model, "a GGUF: its tokenizer.chat_template, BOS and EOS (default: none)");
  c->add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin, with a llama2.c --model");
  c->add_option("--chat-template", o.chat_template,
                "a built-in template (llama3, chatml, mistral, gemma, phi3, llama2) or a file: template text or a "
                "tokenizer_config.json (default: the model's own)");
  c->add_option("--messages", o.messages,
                "JSON file ('-': stdin): an array of messages, or an object with \"messages\" and optionally "
                "\"add_generation_prompt\", \"bos_token\", \"eos_token\" and other variables the template reads");
  c->add_option("--batch", o.batch,
                "JSON file ('-': stdin) of such objects: prints a JSON array, each {\"text\"} or {\"error\"}");
  c->add_option("--bos", o.bos, "the BOS text the template sees (default: the model's, else empty)");
  c->add_option("--eos", o.eos, "the EOS text the template sees (default: the model's, else empty)");
  c->add_flag("--no-generation-prompt", o.no_generation_prompt, "add_generation_prompt = false");
  c->add_flag("--show", o.show, "print the template's text and what kvq knows of it, render nothing");
}

namespace {

nlohmann::ordered_json ReadJson(const std::string& path, const char* option) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    const std::vector<uint8_t> b = read_file_whole(path, 256u << 20, option);
    text.assign(b.begin(), b.end());
  }
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    Fail(option, " '", path, "': not valid JSON (", e.what(), ")");
  }
}

std::string Render(const model::ChatFormat& f, const nlohmann::ordered_json& conv, const ChatTemplateCliOptions& o) {
  model::ChatTemplateInput in;
  in.bos_token = o.bos ? *o.bos : f.bos_text;
  in.eos_token = o.eos ? *o.eos : f.eos_text;
  in.add_generation_prompt = !o.no_generation_prompt;
  if (conv.is_array()) {
    in.messages = conv;
  } else {
    KVQ_CHECK_ARG(conv.is_object() && conv.contains("messages"),
                  "--messages: expected an array of messages or an object with \"messages\"");
    for (auto it = conv.begin(); it != conv.end(); ++it) {
      const std::string& k = it.key();
      if (k == "messages") {
        in.messages = it.value();
      } else if (k == "add_generation_prompt") {
        KVQ_CHECK_ARG(it.value().is_boolean(), "add_generation_prompt: expected a boolean");
        in.add_generation_prompt = it.value().get<bool>();
      } else if ((k == "bos_token" || k == "eos_token") && it.value().is_string()) {
        (k == "bos_token" ? in.bos_token : in.eos_token) = it.value().get<std::string>();
      } else {
        in.extra[k] = it.value();
      }
    }
  }
  return f.tmpl->render(in);
}

}  // namespace

int RunChatTemplate(const ChatTemplateCliOptions& o) {
  KVQ_CHECK_ARG(!o.model.empty() || !o.chat_template.empty(), "--chat-template: give a template, or --model");
  KVQ_CHECK_ARG(o.show || o.messages.empty() != o.batch.empty(), "--messages or --batch: give one of them");
  std::unique_ptr<model::Checkpoint> ckpt;
  std::unique_ptr<model::Tokenizer> own_tok;
  const model::Tokenizer* tok = nullptr;
  if (!o.model.empty()) {
    ckpt = std::make_unique<model::Checkpoint>(o.model);
    tok = ckpt->tokenizer();
    const std::string t = o.tokenizer.empty() ? DefaultTokenizerFor(o.model) : o.tokenizer;
    if (tok == nullptr && !t.empty()) {
      own_tok = std::make_unique<model::Tokenizer>(t, ckpt->config().vocab_size);
      tok = own_tok.get();
    }
  }
  const model::ChatFormat f =
      model::chat_format(tok, ckpt ? ckpt->chat_template() : std::string(), o.chat_template, "--chat-template",
                         /*probe=*/false);
  if (o.show) {
    nlohmann::ordered_json j = {{"origin", f.origin},       {"family", f.family},
                                {"bos_token", f.bos_text},  {"eos_token", f.eos_text},
                                {"end_of_turn", f.end_of_turn}, {"end_of_turn_id", f.end_of_turn_id},
                                {"renders", f.tmpl != nullptr}, {"problem", f.problem},
                                {"template", f.source}};
    std::fputs((j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n").c_str(), stdout);
    return 0;
  }
  KVQ_CHECK_ARG(f.tmpl != nullptr, f.problem);
  if (!o.messages.empty()) {
    const std::string text = Render(f, ReadJson(o.messages, "--messages"), o);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  const nlohmann::ordered_json all = ReadJson(o.batch, "--batch");
  KVQ_CHECK_ARG(all.is_array(), "--batch: expected a JSON array of conversations");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& conv : all) {
    try {
      out.push_back({{"text", Render(f, conv, o)}});
    } catch (const Error& e) {
      out.push_back({{"error", e.what()}});
    }
  }
  std::fputs((out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n").c_str(), stdout);
  return 0;
}

}  // namespace kvq::tools
