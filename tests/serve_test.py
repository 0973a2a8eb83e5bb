"""kvq serve on loopback: OpenAI's completions and chat completions APIs (the chat's prompt is the template's
rendering, its greedy answer the one `kvq generate` gives that prompt; a conversation's next turn reuses its KV
from the prefix store), /tokenize and /detokenize, greedy output identical to `kvq generate`, the KV
budget, the queue and 503, clients that disconnect, two servers sharing a Redis prefix store, bad and slow
clients, SIGTERM.

Run: KVQ_CLI=build/release/kvq /usr/bin/python3 -m pytest -q tests/serve_test.py
(ctest runs it as serve_test).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from loopback import start_redis  # noqa: E402
from serve_client import Server, wait_for  # noqa: E402

KVQ = Path(os.environ.get("KVQ_CLI", ROOT / "build" / "release" / "kvq"))
SHARED = Path(os.environ.get("KVQ_SHARED", os.environ.get("KVQ_DEFAULT_SHARED", ROOT.parent / "shared")))
MODEL = SHARED / "models" / "stories260K" / "stories260K.bin"
TOK = SHARED / "models" / "stories260K" / "tok512.bin"
PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben went to the park", "One day, a little bird"]


@pytest.fixture(scope="module", autouse=True)
def need_binary_and_data():
    if not KVQ.exists():
        pytest.skip(f"{KVQ} is not built (set KVQ_CLI)")
    if not MODEL.exists():
        if os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail(f"KVQ_REQUIRE_DATA=1 but {MODEL} is missing")
        pytest.skip(f"{MODEL} not found (set KVQ_SHARED)")


def stories(*args):
    return ["--model", MODEL, "--tokenizer", TOK, *args]


@pytest.fixture(scope="module")
def slow_gguf(tmp_path_factory):
    """A synthetic GGUF (4 layers, dim 512, 8/4 heads of 64, vocab 4000, F32, no tokenizer: ids in and out)
    slow enough (milliseconds a token) that a long request is still running when the test looks."""
    out = tmp_path_factory.mktemp("serve") / "slow.gguf"
    subprocess.run(["/usr/bin/python3", ROOT / "scripts" / "gguf_write.py", "synthetic", out, "--dim", "512",
                    "--hidden", "1536", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--vocab", "4000",
                    "--ctx", "8192", "--rope-scaling", "none", "--type", "F32"], check=True)
    return out


def generate(kv, prompt, steps=512):
    # steps: the cache's capacity; 512, the server's context (stories260K's), by default, since a preset
    # resolves for its cache's capacity (with layer 0 as token ids, the richest scheme that fits its bits).
    r = subprocess.run([KVQ, "generate", *map(str, stories("--kv", kv, "--prompt", prompt, "--steps", steps))],
                       capture_output=True, text=True, check=True)
    return r.stdout.rstrip("\n")


CHAT = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "Once upon a time"}]


def render(template, messages):
    """The prompt text `kvq chat-template` makes of a conversation (tests/chat_template_test.py holds it
    against python3-jinja2)."""
    r = subprocess.run([KVQ, "chat-template", "--chat-template", template, "--messages", "-", "--bos", "<s>",
                        "--eos", "</s>"], input=json.dumps(messages), capture_output=True, text=True, check=True)
    return r.stdout


def in_threads(fns):
    out = [None] * len(fns)
    errs = []

    def run(i, f):
        try:
            out[i] = f()
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


@pytest.mark.parametrize("kv", ["fp16", "q8_0", "kvq-4.5", "t0+kvq-4.5"])
def test_greedy_output_is_kvq_generates(kv):
    """Four prompts at once, each streamed and not: every completion is the text `kvq generate` prints
    for the same prompt and scheme (the decodes of the running sequences run as one sgemm)."""
    expected = {p: generate(kv, p) for p in PROMPTS}
    with Server(KVQ, stories("--kv", kv, "--max-seqs", "4")) as s:
        body = lambda p: {"model": "stories260K", "prompt": p, "max_tokens": 100, "temperature": 0}  # noqa: E731
        plain = in_threads([lambda p=p: s.post(body(p)) for p in PROMPTS])
        streamed = in_threads([lambda p=p: s.stream(body(p)) for p in PROMPTS])
        m = s.metrics()
    assert s.rc == 0
    for p, (status, b), (text, events) in zip(PROMPTS, plain, streamed):
        assert status == 200, b
        c = b["choices"][0]
        assert b["object"] == "text_completion" and b["model"] == "stories260K" and b["id"].startswith("cmpl-")
        assert expected[p].startswith(p + c["text"]), (p, c["text"], expected[p])
        assert text == c["text"]
        assert c["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 100
        assert b["usage"]["total_tokens"] == b["usage"]["prompt_tokens"] + 100
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert all(e["id"] == events[0]["id"] for e in events[:-1])
    assert m["kvq_requests_finished_total"] == 8 and m["kvq_completion_tokens_total"] == 800
    assert m["kvq_sequences_running_peak"] >= 2  # they did run side by side
    assert m["kvq_kv_bytes"] == 0 and m["kvq_kv_reserved_bytes"] == 0


@pytest.mark.parametrize("template", ["chatml", "llama2"])
def test_chat_completions_answer_what_kvq_generate_makes_of_the_rendered_prompt(template):
    """/v1/chat/completions, plain and streamed: its prompt is the template's rendering (the BOS llama2's template
    writes is the model's BOS, not text), its greedy answer the continuation `kvq generate` prints for that
    prompt; the stream's deltas (role first) add up to the plain answer."""
    prompt = render(template, CHAT)
    if prompt.startswith("<s>"):
        prompt = prompt[len("<s>"):]
    with Server(KVQ, stories("--kv", "q8_0", "--chat-template", template)) as s:
        st, b = s.chat({"model": "stories260K", "messages": CHAT, "max_tokens": 60, "temperature": 0})
        text, events = s.stream({"messages": CHAT, "max_tokens": 60, "temperature": 0,
                                 "stream_options": {"include_usage": True}}, path="/v1/chat/completions")
        st2, _, models = s.request("GET", "/v1/models")
    assert st == 200, b
    c = b["choices"][0]
    assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
    assert c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
    assert b["usage"]["completion_tokens"] == 60
    expected = generate("q8_0", prompt, steps=b["usage"]["prompt_tokens"] + 60)
    assert expected.startswith(prompt + c["message"]["content"]), (prompt, c["message"]["content"], expected)
    assert text == c["message"]["content"]
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-3]["choices"][0]["finish_reason"] == "length" and events[-3]["choices"][0]["delta"] == {}
    assert events[-2]["choices"] == [] and events[-2]["usage"] == b["usage"] and events[-1] == "[DONE]"
    info = json.loads(models)["data"][0]["chat_template"]
    assert info["origin"] == f"built-in {template}" and info["family"] == template
    assert s.rc == 0


def test_a_conversations_next_turn_prefills_only_what_is_new():
    """Multi-turn chat over the default memory: prefix store: turn 2 resends turn 1's conversation, restores
    the KV of its full chunks (kvq_prefix_tokens_reused_total) and prefills only the rest
    (kvq_prefill_tokens_total); the store holds what it says (kvq_prefix_store_bytes); the answer is the one a
    server without the store (--prompt-cache off) gives."""
    args = ("--kv", "fp16", "--chat-template", "chatml", "--prompt-cache-chunk", "16")
    with Server(KVQ, stories(*args)) as s:
        st, b1 = s.chat({"messages": CHAT, "max_tokens": 40, "temperature": 0})
        assert st == 200, b1
        turn2 = CHAT + [{"role": "assistant", "content": b1["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "What happened next?"}]
        m1 = s.metrics()
        st, b2 = s.chat({"messages": turn2, "max_tokens": 30, "temperature": 0})
        assert st == 200, b2
        m2 = s.metrics()
    with Server(KVQ, stories(*args, "--prompt-cache", "off")) as cold:
        st, c2 = cold.chat({"messages": turn2, "max_tokens": 30, "temperature": 0})
        assert cold.metrics()["kvq_prefix_lookups_total"] == 0
    assert b2["choices"][0]["message"] == c2["choices"][0]["message"]
    p1, p2 = b1["usage"]["prompt_tokens"], b2["usage"]["prompt_tokens"]
    reused = m2["kvq_prefix_tokens_reused_total"] - m1["kvq_prefix_tokens_reused_total"]
    prefilled = m2["kvq_prefill_tokens_total"] - m1["kvq_prefill_tokens_total"]
    assert reused >= 16 * (p1 // 16) - 16 and reused > 0, (p1, p2, reused)
    assert prefilled <= p2 - reused, (p2, reused, prefilled)
    # fp16 holds 2 bytes a value: K and V, 5 layers, 4 KV heads of 8 (stories260K) per stored token.
    assert m2["kvq_prefix_store_bytes"] >= 2 * 2 * 5 * 4 * 8 * 16 * (p2 // 16 - 1)


def test_chat_errors_and_tokenize_detokenize(tmp_path):
    """The chat route's 400s (no template, bad messages, unsupported fields, the template's own
    raise_exception), a --chat-template kvq cannot render refused at startup, a GGUF's own template served and
    one kvq cannot render turning only the chat route off; /tokenize and /detokenize round trips."""
    with Server(KVQ, stories()) as s:
        st, b = s.chat({"messages": CHAT})
        assert st == 400 and "--chat-template" in b["error"]["message"] and b["error"]["param"] == "messages"
        st, b = s.post({"prompt": "Once", "max_tokens": 2})
        assert st == 200
        m = json.loads(s.request("GET", "/v1/models")[2])["data"][0]
        assert m["chat_template"] is None and "no chat template" in m["chat_template_problem"]
    with Server(KVQ, stories("--chat-template", "llama2")) as s:
        for body, param, words in [
            ({}, "messages", "required"),
            ({"messages": []}, "messages", "non-empty"),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "not supported"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
             "messages", "text"),
            ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
            ({"messages": CHAT, "n": 2}, "n", "one completion"),
            ({"messages": CHAT, "logprobs": True}, "logprobs", "not supported"),
            ({"messages": CHAT, "prompt": "x"}, "prompt", "Unrecognized"),
            ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
            ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages",
             "must alternate"),
        ]:
            st, b = s.chat(body)
            assert st == 400 and b["error"]["param"] == param and words in b["error"]["message"], (body, b)
        # Content as text parts; developer read as system; max_completion_tokens.
        st, b = s.chat({"messages": [{"role": "developer", "content": "Be kind."},
                                     {"role": "user", "content": [{"type": "text", "text": "Once upon"},
                                                                  {"type": "text", "text": "a time"}]}],
                        "max_completion_tokens": 5, "temperature": 0})
        assert st == 200 and b["usage"]["completion_tokens"] == 5
        prompt = render("llama2", [{"role": "system", "content": "Be kind."},
                                   {"role": "user", "content": "Once upon\na time"}])[len("<s>"):]
        st, p = s.post({"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert p["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert p["choices"][0]["text"] == b["choices"][0]["message"]["content"]
        # /tokenize and /detokenize (llama-server's shapes)
        text = "Once upon a time, café"
        st, _, d = s.request("POST", "/tokenize", {"content": text, "add_special": True})
        ids = json.loads(d)["tokens"]
        assert st == 200 and ids[0] == 1 and len(ids) == s.post({"prompt": text, "max_tokens": 1})[1]["usage"][
            "prompt_tokens"]
        st, _, d = s.request("POST", "/tokenize", {"content": text, "with_pieces": True})
        pieces = json.loads(d)["tokens"]
        assert [p["id"] for p in pieces] == ids[1:]
        assert "".join(p["piece"] for p in pieces).encode("utf-8", "surrogateescape") is not None
        st, _, d = s.request("POST", "/detokenize", {"tokens": ids})
        assert st == 200 and json.loads(d)["content"] == text
        for path, body in [("/tokenize", {}), ("/tokenize", {"content": 5}), ("/tokenize", {"content": "x", "y": 1}),
                           ("/detokenize", {"tokens": [99999]}), ("/detokenize", {"tokens": "x"}),
                           ("/detokenize", b"{")]:
            st, _, d = s.request("POST", path, body)
            assert st == 400 and "error" in json.loads(d), (path, body)
    # A --chat-template kvq cannot render: refused at startup, naming it and the built-ins.
    bad = tmp_path / "macro.jinja"
    bad.write_text("{% macro m() %}{% endmacro %}{{ m() }}")
    r = subprocess.run([KVQ, "serve", *map(str, stories("--chat-template", bad, "--port", "0"))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and str(bad) in r.stderr and "macro" in r.stderr and "chatml" in r.stderr, r.stderr
    r = subprocess.run([KVQ, "serve", *map(str, stories("--chat-template", "nosuch", "--port", "0"))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nosuch" in r.stderr, r.stderr
    # A GGUF's own template: served; one kvq cannot render: the chat route says so, completions still work.
    tpl = tmp_path / "own.jinja"
    tpl.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>")
    for name, template in [("own", tpl), ("bad", bad)]:
        g = tmp_path / f"{name}.gguf"
        subprocess.run(["/usr/bin/python3", ROOT / "scripts" / "gguf_write.py", "synthetic", g, "--dim", "64",
                        "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "300",
                        "--ctx", "256", "--rope-scaling", "none", "--type", "F32", "--tokenizer", "bpe",
                        "--chat-template", template], check=True)
        with Server(KVQ, ["--model", str(g)]) as s:
            m = json.loads(s.request("GET", "/v1/models")[2])["data"][0]
            st, b = s.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
            st2, b2 = s.post({"prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert st2 == 200, b2
        if name == "own":
            assert m["chat_template"]["origin"] == "the GGUF's tokenizer.chat_template", m
            assert st == 200 and b["usage"]["prompt_tokens"] > 0, b
        else:
            assert m["chat_template"] is None and "macro" in m["chat_template_problem"]
            assert st == 400 and "cannot be rendered" in b["error"]["message"] and "--chat-template" in b["error"][
                "message"], b
            assert "/v1/chat/completions is off" in s.stderr
    # A BOS id outside the vocabulary is a broken tokenizer, said so (it was silently ignored).
    g = tmp_path / "bad_bos.gguf"
    subprocess.run(["/usr/bin/python3", ROOT / "scripts" / "gguf_write.py", "synthetic", g, "--dim", "64",
                    "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "300",
                    "--ctx", "256", "--rope-scaling", "none", "--type", "F32", "--tokenizer", "bpe",
                    "--bos-id", "305"], check=True)
    r = subprocess.run([KVQ, "generate", "--model", g, "--prompt", "hi", "--steps", "2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "bos_token_id 305 is outside the vocabulary 0..299" in r.stderr, r.stderr
    # add_bos_token = false (Qwen's): the prompt's first token is text, echoed whole (it was dropped).
    g = tmp_path / "no_bos.gguf"
    subprocess.run(["/usr/bin/python3", ROOT / "scripts" / "gguf_write.py", "synthetic", g, "--dim", "64",
                    "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "300",
                    "--ctx", "256", "--rope-scaling", "none", "--type", "F32", "--tokenizer", "bpe",
                    "--no-add-bos"], check=True)
    for prompt in ["hello world", "Zebra, then"]:
        r = subprocess.run([KVQ, "generate", "--model", g, "--prompt", prompt, "--steps", "24", "--temperature", "0"],
                           capture_output=True, timeout=120)  # bytes: a random model's text need not be UTF-8
        assert r.returncode == 0 and r.stdout.startswith(prompt.encode()), (r.stdout, r.stderr)


def test_endpoints_and_openai_shapes():
    with Server(KVQ, stories("--kv", "q8_0")) as s:
        st, h, d = s.request("GET", "/health")
        assert st == 200 and json.loads(d) == {"status": "ok"}
        st, _, d = s.request("GET", "/v1/models")
        m = json.loads(d)
        assert st == 200 and m["object"] == "list" and m["data"][0]["id"] == "stories260K"
        assert m["data"][0]["kv"] == "q8_0" and m["data"][0]["context_length"] == 512
        assert m["data"][0]["vocab_size"] == 512
        st, h, d = s.request("GET", "/metrics")
        assert st == 200 and h["Content-Type"].startswith("text/plain")
        for name in ["kvq_requests_total", "kvq_prompt_tokens_total", "kvq_completion_tokens_total", "kvq_kv_bytes",
                     "kvq_kv_budget_bytes", "kvq_sequences_running", "kvq_sequences_queued", "kvq_prefix_hits_total",
                     "kvq_prefix_bytes_reused_total", "kvq_step_seconds_total"]:
            assert f"\n{name} " in "\n" + d.decode(), name
        st, _, d = s.request("GET", "/nope")
        assert st == 404 and "error" in json.loads(d)
        # Token ids in, usage counts them; seed and top_p sample reproducibly.
        st, b = s.post({"prompt": [1, 403, 407, 261, 378], "max_tokens": 12, "temperature": 0})
        assert st == 200 and b["usage"]["prompt_tokens"] == 5
        a = s.post({"prompt": "The dog", "max_tokens": 30, "temperature": 0.9, "top_p": 0.8, "seed": 7})[1]
        b2 = s.post({"prompt": "The dog", "max_tokens": 30, "temperature": 0.9, "top_p": 0.8, "seed": 7})[1]
        c = s.post({"prompt": "The dog", "max_tokens": 30, "temperature": 0.9, "top_p": 0.8, "seed": 8})[1]
        assert a["choices"][0]["text"] == b2["choices"][0]["text"] != c["choices"][0]["text"]
        # usage in a stream only when asked
        _, ev = s.stream({"prompt": "The dog", "max_tokens": 3, "stream_options": {"include_usage": True}})
        assert ev[-2]["usage"]["completion_tokens"] == 3 and ev[-2]["choices"] == []
        _, ev = s.stream({"prompt": "The dog", "max_tokens": 3})
        assert all("usage" not in e for e in ev[:-1])


def test_stop_strings_cut_the_text_streamed_or_not():
    full = generate("fp16", "Once upon a time")[len("Once upon a time"):]
    with Server(KVQ, stories()) as s:
        for stop, cut in [(["Lily"], full.index("Lily")), ("girl named", full.index("girl named")),
                          (["zzz", ". "], full.index(". "))]:
            body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stop": stop}
            st, b = s.post(body)
            assert st == 200 and b["choices"][0]["finish_reason"] == "stop", b
            assert b["choices"][0]["text"] == full[:cut]
            text, ev = s.stream(body)
            assert text == full[:cut] and ev[-2]["choices"][0]["finish_reason"] == "stop"


def test_byte_tokens_of_half_a_character_never_abort_the_server():
    """stories260K at temperature 2 samples byte pieces (<0xC3>, <0xA9>, ...): a streamed event never
    carries half a UTF-8 character (it waits for the rest), a byte that no character completes is
    written as U+FFFD, and the server keeps serving (the JSON writer threw on such text and aborted
    it)."""
    with Server(KVQ, stories()) as s:
        seen_high = False
        for seed in (1, 2, 3, 4):
            body = {"prompt": "Once", "max_tokens": 480, "temperature": 2, "seed": seed}
            st, b = s.post(body)
            assert st == 200, b
            text, ev = s.stream(body)
            assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] in ("length", "stop")
            seen_high |= any(ord(ch) >= 0x80 for ch in text + b["choices"][0]["text"])
            # the events carry whole characters: joined, they are the plain reply's text (a character
            # split across two events would come out as two U+FFFD instead)
            assert text == b["choices"][0]["text"], (seed, text, b["choices"][0]["text"])
        assert seen_high, "no non-ASCII byte was sampled: the test proved nothing"
        st, _, d = s.request("GET", "/health")
        assert st == 200 and json.loads(d) == {"status": "ok"}


def test_a_second_server_on_a_port_in_use_is_refused():
    """The listening socket has SO_REUSEADDR only (httplib's default SO_REUSEPORT let a second kvq serve
    start on the same port and take part of its connections): the second exits 2 naming --port."""
    with Server(KVQ, stories()) as s:
        r = subprocess.run([str(KVQ), "serve", "--port", str(s.port), *stories()], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and "--port" in r.stderr and "in use" in r.stderr, (r.returncode, r.stderr[-500:])
        st, _, d = s.request("GET", "/health")
        assert st == 200


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "max_tokens": 1e999}', 400, None),
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": [1, -3]}, 400, "prompt"),
    ({"prompt": [1, 2.5]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**15}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),  # past the 512-token context
    ({"prompt": "x", "max_tokens": "9"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "seed": "s"}, 400, "seed"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": {"x": 1}}, 400, "stream_options"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": "x", "unknown_field": 1}, 400, "unknown_field"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": 3, "prompt": "x"}, 400, "model"),
]


def test_bad_requests_get_openai_errors_and_leave_the_server_serving():
    with Server(KVQ, stories("--max-body-kb", "64")) as s:
        for body, status, param in BAD:
            st, _, d = s.request("POST", "/v1/completions", body)
            assert st == status, (body, st, d)
            e = json.loads(d)["error"]
            assert e["message"] and e["type"] == "invalid_request_error", (body, e)
            if param is not None:
                assert e["param"] == param, (body, e)
        st, _, d = s.request("POST", "/v1/completions", json.dumps({"prompt": "x" * (200 * 1024)}))
        assert st == 413, d
        st, _, _ = s.request("GET", "/v1/completions")
        assert st == 404
        # A chunked body is held to --max-body-kb too (it was read whole: 300 MB were accepted).
        c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Type: application/json\r\n\r\n")
        chunk = b"x" * 16384
        try:
            for _ in range(64):  # 1 MiB, 16x the limit
                c.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            c.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server stopped reading at the limit and hung up
        got = b""
        try:
            while part := c.recv(65536):
                got += part
        except OSError:
            pass
        c.close()
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        st, b = s.post({"prompt": "Once upon a time", "max_tokens": 5})
        assert st == 200 and b["usage"]["completion_tokens"] == 5
        m = s.metrics()
        assert m["kvq_requests_total"] == 1 and m["kvq_requests_finished_total"] == 1
        # Every answer with an error status is counted: the engine's 400s, parse errors, 404 and both 413s.
        assert wait_for(lambda: s.metrics()["kvq_requests_refused_total"] == len(BAD) + 3, 10), s.metrics()
    assert s.rc == 0


def test_queue_503_disconnect_and_budget(slow_gguf):
    """One sequence fits the budget (4 KiB a token in fp16 here): a second request waits in the queue, a
    third gets 503 with Retry-After; a client that hangs up mid-stream has its sequence cancelled and its
    cache freed, and the queued request runs; a request whose cache alone exceeds the budget is a 400."""
    ids = list(range(1, 50))
    with Server(KVQ, ["--model", slow_gguf, "--kv", "fp16", "--kv-budget-mb", "2", "--max-seqs", "4",
                      "--max-queue", "1", "--threads", "1"]) as s:
        st, b = s.post({"prompt": ids, "max_tokens": 1000})
        assert st == 400 and "budget" in b["error"]["message"], b
        got = {}
        first = threading.Event()

        def a_client():
            def on(ev):
                got.setdefault("a", 0)
                got["a"] += 1
                first.set()
                return not got.get("hang_up_a")
            got["a_result"] = s.stream({"prompt": ids, "max_tokens": 400, "temperature": 0}, on_event=on)

        ta = threading.Thread(target=a_client)
        ta.start()
        assert first.wait(60)
        tb = threading.Thread(target=lambda: got.setdefault("b", s.post({"prompt": ids[:20], "max_tokens": 300})))
        tb.start()
        assert wait_for(lambda: s.metrics()["kvq_sequences_queued"] == 1, 30)
        m = s.metrics()
        assert m["kvq_sequences_running"] == 1 and 0 < m["kvq_kv_bytes"] <= m["kvq_kv_budget_bytes"]
        st, h, d = s.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 10})
        assert st == 503 and h.get("Retry-After") == "1" and json.loads(d)["error"]["message"], d
        got["hang_up_a"] = True  # the next event hangs up
        ta.join(60)
        assert wait_for(lambda: s.metrics()["kvq_requests_cancelled_total"] == 1, 30)
        tb.join(120)
        st, b = got["b"]
        assert st == 200 and b["usage"]["completion_tokens"] == 300 and b["choices"][0]["finish_reason"] == "length"
        assert len(got["a_result"][1]) < 400  # a hung up early
        m = wait_for(lambda: (lambda m: m if m["kvq_sequences_running"] == 0 else None)(s.metrics()), 30)
        assert m["kvq_kv_bytes"] == 0 and m["kvq_kv_reserved_bytes"] == 0
        assert m["kvq_kv_bytes_peak"] <= m["kvq_kv_budget_bytes"]
        assert m["kvq_requests_refused_total"] == 2 and m["kvq_requests_finished_total"] == 1
    assert s.rc == 0


@pytest.mark.parametrize("kv,admit", [("q8_0", "guaranteed"), ("kvq-4.5", "guaranteed"), ("kvq-4.5", "packed"),
                                     ("t0+kvq-4.5", "guaranteed")])
def test_the_budget_holds_under_many_requests(kv, admit):
    """A budget that holds three sequences at their full length (512 tokens); twelve requests at once: every
    one completes, at most the budget is ever held (KvCache::bytes after every step), the rest waited.
    "guaranteed" admission preempts nothing; "packed" admits on least bytes and may preempt."""
    with Server(KVQ, stories("--kv", kv)) as probe:
        per_seq = json.loads(probe.request("GET", "/v1/models")[2])["data"][0]["kv_bytes_at_context"]
    budget_mb = 3.5 * per_seq / 1048576
    with Server(KVQ, stories("--kv", kv, "--kv-budget-mb", f"{budget_mb:.6f}", "--max-seqs", "12",
                             "--admit", admit)) as s:
        res = in_threads([lambda i=i: s.post({"prompt": [1] * 12, "max_tokens": 500, "temperature": 0.8,
                                              "seed": i + 1}) for i in range(12)])
        m = s.metrics()
    for st, b in res:
        assert st == 200 and b["choices"][0]["finish_reason"] in ("length", "stop"), b
    assert m["kvq_requests_finished_total"] == 12
    assert 0 < m["kvq_kv_bytes_peak"] <= m["kvq_kv_budget_bytes"]
    assert m["kvq_sequences_running_peak"] >= 3
    assert m["kvq_sequences_running_peak"] < 12
    if admit == "guaranteed":
        assert m["kvq_preemptions_total"] == 0 and m["kvq_sequences_running_peak"] == 3
    assert s.rc == 0


@pytest.fixture
def redis_url():
    p, url = start_redis()
    if p is None:
        if os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail("redis-server is not installed or does not start (scripts/install_deps.sh installs it)")
        pytest.skip("redis-server is not installed")
    yield url, p
    p.kill()
    p.wait()


def test_two_servers_share_prefixes_through_redis(redis_url):
    url, redis = redis_url
    prompt = " ".join(["Lily and Ben went to the park to play with a big red ball."] * 12)
    args = stories("--kv", "q8_0", "--prompt-cache", url, "--prompt-cache-chunk", "32")
    with Server(KVQ, args) as a, Server(KVQ, args) as b:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        sa, ra = a.post(body)
        ma = a.metrics()
        sb, rb = b.post(body)
        mb = b.metrics()
        P = ra["usage"]["prompt_tokens"]
        assert sa == sb == 200 and P > 128
        assert ra["choices"][0]["text"] == rb["choices"][0]["text"]
        assert ma["kvq_prefix_hits_total"] == 0 and ma["kvq_prefix_chunks_stored_total"] == (P - 1) // 32
        assert mb["kvq_prefix_hits_total"] == 1 and mb["kvq_prefix_tokens_reused_total"] == 32 * ((P - 1) // 32)
        assert mb["kvq_prefix_bytes_reused_total"] > 0
        assert mb["kvq_prefill_tokens_total"] == P - 1 - mb["kvq_prefix_tokens_reused_total"]
        assert ma["kvq_prefix_store_up"] == 1
        redis.kill()  # a store fault stays harmless
        redis.wait()
        sc, rc = a.post({**body, "prompt": prompt + " Then they"})
        assert sc == 200 and rc["usage"]["completion_tokens"] == 40
        assert a.metrics()["kvq_prefix_store_up"] == 0  # said, not silent
        # Redis back on its port: after the retry time (2 s) the store is used again, not off for good.
        port = int(url.rsplit(":", 1)[1])
        back = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--logfile", "/dev/null"])
        try:
            def answers():
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    return True
                except OSError:
                    return False

            assert wait_for(answers, 10)
            time.sleep(2.5)
            stored = a.metrics()["kvq_prefix_chunks_stored_total"]
            sc, _ = a.post(body)
            assert sc == 200
            m = a.metrics()
            assert m["kvq_prefix_store_up"] == 1 and m["kvq_prefix_chunks_stored_total"] > stored, m
            assert "reconnected" in "".join(a._err)
        finally:
            back.kill()
            back.wait()
    assert a.rc == 0 and b.rc == 0


def test_sigterm_lets_running_requests_finish_then_exits_0(slow_gguf):
    with Server(KVQ, ["--model", slow_gguf, "--kv", "q8_0", "--threads", "1"]) as s:
        started = threading.Event()
        out = {}

        def client():
            out["r"] = s.stream({"prompt": [1, 2, 3], "max_tokens": 150, "temperature": 0},
                                on_event=lambda ev: started.set())

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # while draining: refused (503) or no longer listening
            st, _, _ = s.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, timeout=10)
            assert st == 503
        except OSError:
            pass
        t.join(120)
        rc = s.stop()
    text, events = out["r"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert rc == 0 and "stopped after" in s.stderr


def test_a_second_ctrl_c_exits_at_once(slow_gguf):
    """The first SIGINT drains (running requests finish); a second one exits now, with 128 + SIGINT."""
    with Server(KVQ, ["--model", slow_gguf, "--kv", "fp16", "--threads", "1"]) as s:
        started = threading.Event()
        t = threading.Thread(target=lambda: s.stream({"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0},
                                                     on_event=lambda ev: started.set()))
        t.daemon = True
        t.start()
        assert started.wait(60)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert s.proc.poll() is None  # still draining: 4000 tokens take far longer
        t0 = time.time()
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(timeout=20)
        assert rc == 128 + signal.SIGINT and time.time() - t0 < 10, rc
        t.join(30)


def test_slow_clients_time_out_without_holding_up_the_others():
    with Server(KVQ, stories("--timeout", "2")) as s:
        slow = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        for c in slow:  # headers that promise a body never sent
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prom")
        t0 = time.time()
        for p in PROMPTS:
            st, b = s.post({"prompt": p, "max_tokens": 8})
            assert st == 200 and b["usage"]["completion_tokens"] == 8
        assert time.time() - t0 < 2  # served while the slow ones hang
        for c in slow:
            c.settimeout(15)
            got = b""
            while chunk := c.recv(4096):  # after its timeout: a 400 at most, then the server hangs up
                got += chunk
            assert got == b"" or got.startswith(b"HTTP/1.1 400"), got
            c.close()
        m = s.metrics()
        assert m["kvq_requests_total"] == m["kvq_requests_finished_total"] == 4
    assert s.rc == 0


def raw_exchange(port, data, timeout=30, source="127.0.0.1", half_close=False):
    """Sends `data` on one connection and reads until the server closes it (or `timeout`): (bytes, seconds)."""
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    t0 = time.time()
    got = b""
    try:
        c.sendall(data)
        if half_close:
            c.shutdown(socket.SHUT_WR)
        while part := c.recv(65536):
            got += part
    except OSError:
        pass
    c.close()
    return got, time.time() - t0


def test_http_framing_pipelining_and_http10():
    """Pipelined requests each answered, in order (the bytes past the first were dropped); a Content-Length over
    the limit, negative or not a number, a transfer coding other than chunked, Transfer-Encoding with
    Content-Length (request smuggling's pair) and chunked in HTTP/1.0 answered at once and the connection closed;
    a stream to an HTTP/1.0 client is not chunked (it runs to the connection's end)."""
    with Server(KVQ, stories("--kv", "fp16", "--max-body-kb", "64")) as s:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
        one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
        last = one.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
        got, _ = raw_exchange(s.port, one + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + last)
        assert got.count(b"HTTP/1.1 200 OK") == 3, got
        parts = got.split(b"HTTP/1.1 200 OK")
        assert b'"text_completion"' in parts[1] and b'"status":"ok"' in parts[2] and b'"text_completion"' in parts[3]

        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        cases = [
            (b"Content-Length: 999999999\r\n", b"413"),
            (b"Content-Length: -5\r\n", b"400"),
            (b"Content-Length: 12abc\r\n", b"400"),
            (b"Content-Length: 5\r\nContent-Length: 5\r\n", b"400"),
            (b"Transfer-Encoding: gzip\r\n", b"501"),
            (b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", b"400"),
        ]
        for hdr, status in cases:
            got, secs = raw_exchange(s.port, head + hdr + b"\r\n{")  # the body never comes
            assert got.startswith(b"HTTP/1.1 " + status), (hdr, got[:300])
            assert b"Connection: close" in got and secs < 5, (hdr, secs)
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"], got
        got, _ = raw_exchange(s.port, head.replace(b"HTTP/1.1", b"HTTP/1.0") +
                              b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400"), got[:300]

        stream = json.dumps({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                             "stream": True}).encode()
        got, _ = raw_exchange(s.port, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(stream) + stream)
        headers, sse = got.split(b"\r\n\r\n", 1)
        assert b" 200 " in headers.split(b"\r\n")[0] and b"chunked" not in headers.lower(), headers
        assert sse.startswith(b"data: {") and sse.endswith(b"data: [DONE]\n\n"), sse[:200]
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in sse.decode().split("\n\n")
                       if line.startswith("data: {"))
        assert text == s.post({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})[1]["choices"][0][
            "text"]
        st, b = s.post({"prompt": "Once upon a time", "max_tokens": 3})
        assert st == 200, b
    assert s.rc == 0


def test_trickling_connections_neither_starve_others_nor_stay(slow_gguf):
    """300 connections from one address sending a byte of their request head a second: at most
    --max-client-connections of them are held (the rest get 503 at once), none past --request-timeout, and a
    client at another address is served meanwhile as fast as on an idle server."""
    with Server(KVQ, stories("--kv", "fp16", "--request-timeout", "4", "--connections", "64")) as s:
        t0 = time.time()
        assert s.post({"prompt": "Once upon a time", "max_tokens": 8})[0] == 200
        idle_s = time.time() - t0
        socks = []
        for _ in range(300):
            c = socket.socket()
            c.settimeout(30)
            c.bind(("127.0.0.2", 0))
            c.connect(("127.0.0.1", s.port))
            socks.append(c)
        stop = threading.Event()
        refused = []

        def trickle():
            msg = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
            for i in range(len(msg)):
                for c in list(socks):
                    try:
                        c.send(msg[i:i + 1])
                    except OSError:
                        socks.remove(c)
                        refused.append(c)
                if stop.wait(1.0):
                    return

        th = threading.Thread(target=trickle, daemon=True)
        th.start()
        time.sleep(1.5)
        served = []
        for _ in range(5):  # from 127.0.0.1: the trickling address's cap leaves it threads
            t0 = time.time()
            st, b = s.post({"prompt": "Once upon a time", "max_tokens": 8}, timeout=30)
            served.append(time.time() - t0)
            assert st == 200, b
        assert max(served) < idle_s + 2, (served, idle_s)
        m = s.metrics()
        assert m["kvq_connections_refused_total"] >= 300 - 32, m  # half of --connections 64 held, the rest 503
        # the held 32, plus this client's own: the metrics request and any of the five posts' connections whose
        # close the server has not yet seen (one flaky run of the whole file in five)
        assert m["kvq_connections_open"] <= 32 + 6, m
        # The held ones are cut off at the deadline (4 s from their first byte), not when the head completes.
        assert wait_for(lambda: s.metrics()["kvq_requests_timed_out_total"] >= 32, 15), s.metrics()
        assert wait_for(lambda: s.metrics()["kvq_connections_open"] <= 1, 15), s.metrics()
        stop.set()
        th.join(10)
        for c in socks + refused:
            c.close()
        assert s.post({"prompt": "Once upon a time", "max_tokens": 8})[0] == 200
    assert s.rc == 0


def test_a_connection_past_the_per_address_cap_gets_an_openai_503():
    with Server(KVQ, stories("--kv", "fp16", "--max-client-connections", "1")) as s:
        held = socket.create_connection(("127.0.0.1", s.port), timeout=30)  # the address's one connection
        held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1 200")  # served, and kept alive
        got, _ = raw_exchange(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True)
        assert got.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in got, got[:300]
        e = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert e["type"] == "server_busy" and "--max-client-connections 1" in e["message"], e
        held.close()
        assert wait_for(lambda: raw_exchange(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close"
                                                     b"\r\n\r\n")[0].startswith(b"HTTP/1.1 200"), 10)
    assert s.rc == 0


def test_many_connections_at_once_each_answered_once_and_memory_returns_to_idle():
    """3 x 48 requests at once, each answered once, 48 sequences running at once (their fp32 caches ~30 MiB
    together); afterwards the process's RSS is back within 12 MiB of what it was idle after a first small
    request (the freed caches handed back: malloc_trim). Not asserted under ASan, whose allocator keeps freed memory
    in quarantine."""
    asan = b"__asan_init" in KVQ.read_bytes()  # an ASan build links the runtime by this symbol
    with Server(KVQ, stories("--kv", "fp32", "--max-seqs", "48", "--max-queue", "64")) as s:
        assert s.post({"prompt": PROMPTS[0], "max_tokens": 8})[0] == 200  # BLAS buffers, thread stacks: idle
        assert wait_for(lambda: s.metrics()["kvq_sequences_running"] == 0, 30)
        idle_kb = s.rss_kb()
        tokens = 0
        for _ in range(3):
            res = in_threads([lambda i=i: s.post({"prompt": PROMPTS[i % 4], "max_tokens": 480, "temperature": 0.7,
                                                  "seed": i + 1}) for i in range(48)])
            assert all(st == 200 and b["usage"]["completion_tokens"] > 0 for st, b in res)
            assert len({b["id"] for _, b in res}) == 48  # none answered twice
            tokens += sum(b["usage"]["completion_tokens"] for _, b in res)
        m = s.metrics()
        assert m["kvq_requests_total"] == m["kvq_requests_finished_total"] == 145
        assert 8 <= m["kvq_sequences_running_peak"] <= 48
        assert wait_for(lambda: s.metrics()["kvq_sequences_running"] == 0, 30)
        peak_kb, after_kb = s.rss_kb("VmHWM"), s.rss_kb()
        print(f"RSS before {idle_kb} KiB, peak {peak_kb} KiB, after {after_kb} KiB; KV peak "
              f"{m['kvq_kv_bytes_peak'] / 1048576:.1f} MiB; {tokens} tokens")
        if not asan:
            assert after_kb <= idle_kb + 12 * 1024, (idle_kb, peak_kb, after_kb)
    assert s.rc == 0


def test_openais_official_client_reads_the_server():
    """npm `openai` (scripts/install_deps.sh puts it in build/oracles): list, complete, stream, an error."""
    oracles = Path(os.environ.get("KVQ_ORACLES", ROOT / "build" / "oracles"))
    if shutil.which("node") is None or not (oracles / "node_modules" / "openai").exists():
        msg = f"node or the npm package openai is missing from {oracles} (KVQ_WITH_ORACLES=1 scripts/install_deps.sh)"
        if os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    with Server(KVQ, stories("--kv", "q8_0", "--chat-template", "chatml")) as s:
        r = subprocess.run(["node", ROOT / "tests" / "openai_client.mjs", oracles, f"http://127.0.0.1:{s.port}/v1",
                            "Once upon a time", "40", json.dumps(CHAT)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        st, b = s.post({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0})
        st, c = s.chat({"messages": CHAT, "max_tokens": 40, "temperature": 0})
    assert got["models"] == ["stories260K"]
    assert got["text"] == got["streamed"] == b["choices"][0]["text"]
    assert got["finish_reason"] == got["stream_finish_reason"] == "length"
    assert got["usage"] == b["usage"]
    assert got["error_status"] == 400 and got["error_param"] == "max_tokens"
    # chat.completions.create, plain and streamed: equal to each other and to what kvq generate makes of the
    # rendered prompt.
    expected = generate("q8_0", render("chatml", CHAT), steps=c["usage"]["prompt_tokens"] + 40)
    assert got["chat_text"] == got["chat_streamed"] == c["choices"][0]["message"]["content"]
    assert expected.startswith(render("chatml", CHAT) + got["chat_text"])
    assert got["chat_object"] == "chat.completion" and got["chat_role"] == got["chat_stream_role"] == "assistant"
    assert got["chat_finish_reason"] == got["chat_stream_finish_reason"] == "length"
    assert got["chat_usage"] == got["chat_stream_usage"] == c["usage"]
    assert got["chat_error_status"] == 400 and got["chat_error_param"] == "tools"
