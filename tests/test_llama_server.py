"""`atlas-llama-server`: llama-server's command lines read as llama-server reads them (Lemonade's
launch line with its users' llamacpp_args, the short flags argparse would split, --version,
-hf, the refusals), each flag's atlas meaning, and the server Lemonade starts, stops and
reads timings from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import UsageError
from atlas_cli.serve import llama_args, llama_server
from atlas_cli.serve.llama_server import plan
from tests.serve_helpers import ASK, dumps, free_port, raw_request, wait_for_health

# what lemond 11.7.0 starts its llama.cpp backend with (-m, --ctx-size, --port, --jinja,
# --metrics, then its overridable defaults), before the user's llamacpp_args
LEMONADE = "-m /m/q.gguf --ctx-size 4096 --port 8123 --jinja --metrics --keep 16"
LEMONADE += " --reasoning-format auto --no-ui"


def launch(argv: str, device: str = "cpu", environ: dict | None = None):
    return plan(argv.split(), {} if environ is None else environ, lambda: device)


# (command line, the device atlas would pick, what the launch must hold)
COMMAND_LINES = [
    (LEMONADE, "cpu", {"model": "/m/q.gguf", "port": 8123, "ctx_size": 4096, "kv_dtype": None}),
    # the users' llamacpp_args that broke the argparse parser: -ctk is not -c tk, -cb not -c b
    (LEMONADE + " -ctk q8_0 -cb", "cuda", {"ctx_size": 4096, "kv_dtype": "fp8"}),
    (LEMONADE + " -ctk q8_0 -ctv q8_0 -cb", "cpu", {"ctx_size": 4096, "kv_dtype": None}),
    ("-m q.gguf -ctk f16 -ctv f16", "cpu", {"kv_dtype": "f16"}),
    ("-m q.gguf --cache-type-k bf16", "cuda", {"kv_dtype": "bf16"}),
    ("-m q.gguf -ctk f32 -ctv q8_0", "cuda", {"kv_dtype": "f32"}),
    # -mg is not -m g: the model path survives
    ("-m q.gguf -mg 0", "cpu", {"model": "q.gguf", "device": None}),
    ("-m q.gguf -c 0 -np 1 -nocb -fa on -ngl 99", "cpu", {"ctx_size": None}),
    ("-m q.gguf -fa -t 4 -tb 8", "cpu", {"threads": 4}),
    ("-m q.gguf -t -1 --ctx_size 8192", "cpu", {"threads": None, "ctx_size": 8192}),
    ("-m q.gguf --device none", "cuda", {"device": "cpu"}),
    ("-m q.gguf -dev CUDA0", "cuda", {"device": "cuda"}),
    ("-m q.gguf --device ROCm0", "hip", {"device": "hip"}),
    ("-m q.gguf -ngl 0", "cuda", {"device": "cpu"}),
    ("-hf unsloth/Qwen3-0.6B-GGUF:Q4_0", "cpu", {"model": "hf.co/unsloth/Qwen3-0.6B-GGUF:Q4_0"}),
    ("--hf-repo hf.co/org/repo", "cpu", {"model": "hf.co/org/repo"}),
    ("-m q.gguf -a tiny,other --host 0.0.0.0", "cpu", {"served_model_name": "tiny"}),
    ("-m q.gguf --api-key sk-1 -to 600", "cpu", {"api_key": "sk-1"}),
    ("-m q.gguf --cache-ram 0", "cpu", {"cache_bytes": 0}),
    ("-m q.gguf -cram 1024", "cpu", {"cache_bytes": 1 << 30}),
    ("-m q.gguf --cache-ram -1", "cpu", {"cache_bytes": None}),
    ("-m q.gguf", "cpu", {"slot_save_path": None}),
    ("-m q.gguf --slot-save-path /m/slots", "cpu", {"slot_save_path": "/m/slots"}),
    ("-m q.gguf --spec-type none --spec-draft-n-max 3", "cpu", {"draft": 0}),
    ("-m q.gguf --spec-type draft-mtp --spec-draft-n-max 3", "cpu", {"draft": 3}),
    ("-m q.gguf --draft-max 2 --spec-draft-p-min 0.75", "cpu", {"draft": 2}),
    (
        "-m q.gguf --reasoning-budget 0",
        "cpu",
        {
            "template_kwargs": {"enable_thinking": False},
            "sampling": SamplingOverrides(reasoning_budget=0),
        },
    ),
    (
        "-m q.gguf --reasoning-budget 256",
        "cpu",
        {"sampling": SamplingOverrides(reasoning_budget=256)},
    ),
    ("-m q.gguf --reasoning-budget -1", "cpu", {"sampling": None}),
    ("-m q.gguf -rea on", "cpu", {"template_kwargs": {"enable_thinking": True}}),
    ("-m q.gguf --reasoning off", "cpu", {"template_kwargs": {"enable_thinking": False}}),
    ("-m q.gguf -v", "cpu", {"log_level": "debug"}),
    ("-m q.gguf --log-disable", "cpu", {"log_level": "warning"}),
    (
        "-m q.gguf --temp 0.6 --top-k 20 --seed 7",
        "cpu",
        {"sampling": SamplingOverrides(temperature=0.6, top_k=20, seed=7)},
    ),  # fmt: skip
    ("-m q.gguf -s -1 --min-p 0", "cpu", {"sampling": SamplingOverrides(min_p=0.0)}),
    ("-m q.gguf --seed -1", "cpu", {"sampling": None}),
]


@pytest.mark.parametrize(("argv", "device", "expected"), COMMAND_LINES)
def test_command_lines_read_as_llama_server_reads_them(argv, device, expected):
    got = launch(argv, device)
    fields = {"model": got.model, "threads": got.threads, **got.serve}
    assert {k: fields[k] for k in expected} == expected
    assert got.serve["accept_any_model"] is True


def test_lemonade_launch_line_lists_what_atlas_does_not_use():
    got = launch(LEMONADE + " -ctk q8_0 -cb --context-shift -ngl 99", device="cpu")
    assert got.ignored == [
        "--keep 16",
        "-cb",
        "--context-shift",
        "-ctk q8_0 (cpu keeps its KV cache in f16 or f32)",
        "-ngl 99 (atlas keeps the whole model on its device)",
    ]
    assert launch(LEMONADE + " -ctk q8_0", device="cuda").ignored == [
        "--keep 16",
        "-ctk q8_0 (fp8 instead: the nearest on cuda)",
    ]
    assert launch("-m q.gguf -ctk q8_0 -ctv f16", device="cuda").ignored == [
        "-ctk q8_0 (bf16 instead: atlas has one type for K and V)",
        "-ctv f16 (bf16 instead: the nearest on cuda)",
    ]


def test_flags_atlas_already_follows_are_not_reported():
    argv = "-m q.gguf --jinja --metrics --slots --no-webui --reasoning-format deepseek -ctk f16"
    assert launch(argv, device="cpu").ignored == []


def test_every_ignored_flag_is_taken_whole_with_its_values():
    for nargs, flags in llama_args.IGNORED.items():
        values = {0: [], 1: ["1"], "?": ["on"], 2: ["a", "b"]}[nargs]
        for names in flags:
            for name in names.split():
                ns = llama_args.parse(["-m", "q.gguf", name, *values, "-c", "64"])
                assert (ns.model, ns.ctx_size) == ("q.gguf", 64), name
                assert ns.ignored == [" ".join([name, *values])]


def test_optional_values_are_optional():
    ns = llama_args.parse(["-fa", "-m", "q.gguf", "-fit", "-rea"])
    assert (ns.model, ns.reasoning, ns.ignored) == ("q.gguf", "on", ["-fa", "-fit"])


def test_gpu_numbers_pick_the_runtime_visible_device():
    environ = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert launch("-m q.gguf --device CUDA1", environ=environ).serve["device"] == "cuda"
    assert environ == {"CUDA_VISIBLE_DEVICES": "5"}
    environ = {}
    assert launch("-m q.gguf --device ROCm0,ROCm1 -mg 1", environ=environ).serve["device"] == "hip"
    assert environ == {"HIP_VISIBLE_DEVICES": "1"}
    environ = {}
    assert launch("-m q.gguf -mg 2", environ=environ).serve["device"] is None
    assert environ == {"CUDA_VISIBLE_DEVICES": "2", "HIP_VISIBLE_DEVICES": "2"}
    environ = {}
    got = launch("-m q.gguf --device CUDA0,CUDA1", environ=environ)
    assert environ == {} and got.ignored == ["--device CUDA0,CUDA1 (atlas runs on one: CUDA0)"]


def test_pull_settings_reach_the_environment():
    environ = {}
    launch("-hf org/repo:Q8_0 -hft hf_abc --offline", environ=environ)
    assert environ == {"HF_TOKEN": "hf_abc", "HF_HUB_OFFLINE": "1"}


def test_the_default_device_is_asked_only_after_the_gpu_is_picked():
    environ: dict[str, str] = {}
    seen = []

    def default_device():
        seen.append(dict(environ))
        return "cuda"

    plan(["-m", "q.gguf", "-mg", "1", "-ctk", "f16"], environ, default_device)
    assert seen == [{"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}]


def test_api_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the server's key\nsk-file\n\n")
    assert launch(f"-m q.gguf --api-key-file {keys}").serve["api_key"] == "sk-file"
    keys.write_text("sk-1\nsk-2\n")
    with pytest.raises(UsageError, match="one API key, not 2"):
        launch(f"-m q.gguf --api-key-file {keys}")


def test_template_kwargs_json_wins_over_the_thinking_switch():
    argv = ["-m", "q.gguf", "--reasoning-budget", "0"]
    argv += ["--chat-template-kwargs", '{"enable_thinking": true, "x": 1}']
    got = plan(argv, {}, lambda: "cpu")
    assert got.serve["template_kwargs"] == {"enable_thinking": True, "x": 1}


REFUSED = [
    ("-m q.gguf --model-draft d.gguf", "--model-draft: atlas has no draft models"),
    ("-m q.gguf -md d.gguf", "-md: atlas has no draft models: it drafts with the model's own MTP"),
    ("-m q.gguf --mmproj p.gguf", "--mmproj: atlas runs text models only"),
    ("-m q.gguf --embeddings", "--embeddings: atlas serves no embedding models yet"),
    ("-m q.gguf --reranking", "--reranking: atlas serves no reranking models yet"),
    ("-m q.gguf --lora a.gguf", "--lora: atlas applies no LoRA adapters"),
    ("-hf org/repo -hff x.gguf", "-hff: atlas picks a repository's GGUF by its quant"),
    ("-m q.gguf --device Vulkan0", "--device Vulkan0: atlas runs on none (the CPU), CUDA0"),
    ("-m q.gguf -ctk q9_0", "-ctk q9_0: llama-server's KV types are f32, f16, bf16, q8_0"),
    ("-m q.gguf -hf org/repo", "give -m PATH or -hf ORG/REPO[:QUANT], not both"),
    ("--port 8080", "no model: give -m PATH or -hf ORG/REPO[:QUANT]"),
    ("-m q.gguf --api-key a,b", "atlas takes one API key, not 2"),
    ("-m q.gguf --host 127.0.0.1,::1", "atlas listens on one TCP address"),
    ("-m q.gguf -mg 1 --device CUDA0", "-mg 1: --device CUDA0 names 1 device(s)"),
    # not llama-server flags, and so not split into a known short flag and a value
    ("-m q.gguf -ctkx q8_0", "invalid argument: -ctkx (not a llama-server flag)"),
    ("-m q.gguf -ng 99", "invalid argument: -ng (not a llama-server flag)"),
    ("-m q.gguf --ctx-siz 64", "invalid argument: --ctx-siz (not a llama-server flag)"),
    ("-m q.gguf -c tk", "argument -c/--ctx-size: invalid int value: 'tk'"),
    ("-m q.gguf --port", "argument --port: expected one argument"),
    ("-m q.gguf stray", "unrecognized arguments: stray"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED)
def test_refused_in_one_line(argv, message):
    with pytest.raises(UsageError) as err:
        launch(argv)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_main_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as done:
        llama_server.main(["-m", "q.gguf", "--mmproj", "p.gguf"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "atlas-llama-server: error: --mmproj: atlas runs text models only: it has no vision "
        "projector\n"
    )


def test_version_exits_0(capsys):
    with pytest.raises(SystemExit) as done:
        llama_server.main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # Lemonade reads a build number out of llama-server's first line: "version: N (commit)"
    assert out.startswith("version: ") and out.split()[1][0].isdigit()


def test_list_devices_names_gpus_as_llama_cpp(monkeypatch, capsys):
    from atlas_cli import hardware

    gpus = (
        hardware.GPU("nvidia", "NVIDIA H100", "sm_90", 80 << 30),
        hardware.GPU("amd", "AMD Radeon 8060S", "gfx1151", 96 << 30, index=1),
    )
    monkeypatch.setattr(hardware, "probe", lambda: hardware.Probe(gpus=gpus))
    with pytest.raises(SystemExit) as done:
        llama_server.main(["--list-devices"])
    assert done.value.code == 0
    assert capsys.readouterr().out.splitlines() == [
        "Available devices:",
        "  CUDA0: NVIDIA H100 (81920 MiB)",
        "  ROCm1: AMD Radeon 8060S (98304 MiB)",
    ]


def test_main_serves_hf_models_through_atlas_pull(monkeypatch, capsys):
    from atlas_cli import cpu_threads, session
    from atlas_cli.serve import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda model, **kw: calls.append((model, kw)))
    monkeypatch.setattr(session, "default_device", lambda: "cpu")
    monkeypatch.setattr(cpu_threads, "use_threads", lambda n: calls.append(("threads", n)))
    llama_server.main(["-hf", "org/Repo-GGUF:Q8_0", "--port", "9000", "-t", "2", "-cb"])
    assert calls[0] == ("threads", 2)
    model, kw = calls[1]
    assert model == "hf.co/org/Repo-GGUF:Q8_0"  # atlas_cli.session.resolve pulls it
    assert (kw["port"], kw["served_model_name"]) == (9000, "org/Repo-GGUF:Q8_0")
    assert capsys.readouterr().err == "atlas-llama-server: ignoring -cb\n"


@pytest.mark.slow
def test_lemonade_starts_reads_and_stops_the_server(smollm2_path):
    """The server as Lemonade drives it: its launch line with a user's `-ctk q8_0 -cb`,
    ready when GET /health answers 200, llama.cpp timings read from an answer, stopped with
    SIGTERM (Lemonade kills it 5 s later)."""
    port = free_port()
    argv = [sys.executable, "-m", "atlas_cli.serve.llama_server", "-m", str(smollm2_path)]
    argv += f"--ctx-size 512 --port {port} --jinja --metrics -ctk q8_0 -cb".split()
    env = {**os.environ, "ATLAS_DEVICE": "cpu"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        status = wait_for_health(port, proc)
        assert status == 200, proc.stderr.read() if proc.poll() is not None else "no health"
        body = {"model": "whatever-lemonade-calls-it", "messages": ASK, "max_tokens": 4}
        status, _, raw = raw_request(port, "POST", "/v1/chat/completions", dumps(body))
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["timings"]["predicted_n"] == answer["usage"]["completion_tokens"] > 0
        assert answer["timings"]["prompt_per_second"] > 0
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then re-raises the signal (0 from versions that do not)
        assert proc.wait(5) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read()
    assert "atlas-llama-server: ignoring -cb, -ctk q8_0 (cpu keeps its KV cache" in log, log


def test_server_sampling_and_drafting_go_over_the_recipe_defaults(tmp_path):
    from atlas_cli.backend.defaults import RunDefaults
    from atlas_cli.serve.server import with_defaults
    from atlas_cli.session import Resolved

    recipe = RunDefaults(sampling=SamplingOverrides(temperature=0.7, top_k=20), draft=None)
    resolved = Resolved("m", tmp_path, "cpu", recipe)
    got = with_defaults(resolved, SamplingOverrides(temperature=0.6), 2).defaults
    assert got.sampling == SamplingOverrides(temperature=0.6, top_k=20) and got.draft == 2
    assert with_defaults(resolved, None, None) == resolved
