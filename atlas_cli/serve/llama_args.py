"""llama-server's command line, read the way llama.cpp reads it (common/arg.cpp).

llama.cpp matches every argument whole against its flag list (`--foo_bar` is `--foo-bar`), and a
flag takes a fixed number of values. argparse instead reads a single-dash token it does not know
as a known short flag glued to its value: undeclared, `-ctk q8_0` is `-c tk` and `-mg 0` is
`-m g`. So every llama-server flag is declared here (argparse matches a declared one whole
before trying anything else), and a token that looks like a flag but is none of them is refused
as llama-server refuses it, before argparse can split it.

Each flag is one of: a setting atlas has too (read by `llama_server.plan`), a llama.cpp setting
atlas has no use for (accepted, listed on stderr in one line), or a feature atlas does not have
(refused in one line that says what atlas does instead, exit code 2).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Sequence

from atlas_cli import __version__
from atlas_cli.errors import UsageError

PROG = "atlas-llama-server"

# argparse's own test for a token that is a value although it starts with "-"
NEGATIVE_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")

# llama.cpp settings atlas accepts and has no use for, by how many values each takes ("?": an
# optional on/off/auto); each string is one flag and its aliases
IGNORED: dict[int | str, tuple[str, ...]] = {
    0: (
        "-cb --cont-batching",
        "-nocb --no-cont-batching",
        "--swa-full",
        "--perf",
        "--no-perf",
        "-e --escape",
        "--no-escape",
        "-kvo --kv-offload",
        "-nkvo --no-kv-offload",
        "--repack",
        "-nr --no-repack",
        "--no-host",
        "--mlock",
        "--mmap",
        "--no-mmap",
        "-dio --direct-io",
        "-ndio --no-direct-io",
        "-cmoe --cpu-moe",
        "-cmoed --cpu-moe-draft --spec-draft-cpu-moe",
        "--check-tensors",
        "--op-offload",
        "--no-op-offload",
        "--log-jsonl",
        "--no-log-jsonl",
        "--log-prefix",
        "--no-log-prefix",
        "--log-timestamps",
        "--no-log-timestamps",
        "--ignore-eos",
        "-bs --backend-sampling",
        "-kvu --kv-unified",
        "-no-kvu --no-kv-unified",
        "--cache-idle-slots",
        "--no-cache-idle-slots",
        "--context-shift",
        "--no-context-shift",
        "-sp --special",
        "--warmup",
        "--no-warmup",
        "--spm-infill",
        "--mmproj-auto",
        "--no-mmproj-auto",
        "--mmproj-offload",
        "--reuse-port",
        "--cors-credentials",
        "--no-cors-credentials",
        "--ui-mcp-proxy --webui-mcp-proxy",
        "--no-ui-mcp-proxy --no-webui-mcp-proxy",
        "-ag --agent",
        "-no-ag --no-agent",
        "--ui --webui",
        "--cache-prompt",
        "--no-cache-prompt",
        "--props",
        "--no-slots",
        "--models-autoload",
        "--no-models-autoload",
        "--skip-chat-parsing",
        "--no-skip-chat-parsing",
        "--prefill-assistant",
        "--no-prefill-assistant",
        "--reasoning-preserve",
        "--no-reasoning-preserve",
        "--lora-init-without-apply",
        "--spec-draft-backend-sampling",
        "--no-spec-draft-backend-sampling",
        "--spec-default",
        "--no-jinja",
    ),
    1: (
        "-tb --threads-batch",
        "-C --cpu-mask",
        "-Cr --cpu-range",
        "--cpu-strict",
        "--prio",
        "--poll",
        "-Cb --cpu-mask-batch",
        "-Crb --cpu-range-batch",
        "--cpu-strict-batch",
        "--prio-batch",
        "--poll-batch",
        "-n --predict --n-predict",
        "-b --batch-size",
        "-ub --ubatch-size",
        "--keep",
        "--rope-scaling",
        "--rope-scale",
        "--rope-freq-base",
        "--rope-freq-scale",
        "--yarn-orig-ctx",
        "--yarn-ext-factor",
        "--yarn-attn-factor",
        "--yarn-beta-slow",
        "--yarn-beta-fast",
        "-dt --defrag-thold",
        "--rpc",
        "-lm --load-mode",
        "--numa",
        "-ot --override-tensor",
        "-ncmoe --n-cpu-moe",
        "-sm --split-mode",
        "-ts --tensor-split",
        "-fitt --fit-target",
        "-fitc --fit-ctx",
        "--override-kv",
        "--log-file",
        "-lv --verbosity --log-verbosity",
        "-ctkd --cache-type-k-draft --spec-draft-type-k",
        "-ctvd --cache-type-v-draft --spec-draft-type-v",
        "--samplers",
        "--sampler-seq --sampling-seq",
        "--top-nsigma --top-n-sigma",
        "--xtc-probability",
        "--xtc-threshold",
        "--typical --typical-p",
        "--repeat-last-n",
        "--frequency-penalty",
        "--dry-multiplier",
        "--dry-base",
        "--dry-allowed-length",
        "--dry-penalty-last-n",
        "--dry-sequence-breaker",
        "--adaptive-target",
        "--adaptive-decay",
        "--dynatemp-range",
        "--dynatemp-exp",
        "--mirostat",
        "--mirostat-lr",
        "--mirostat-ent",
        "-l --logit-bias",
        "--grammar",
        "--grammar-file",
        "-j --json-schema",
        "-jf --json-schema-file",
        "-lcs --lookup-cache-static",
        "-lcd --lookup-cache-dynamic",
        "-ctxcp --ctx-checkpoints --swa-checkpoints",
        "-cms --checkpoint-min-step",
        "-r --reverse-prompt",
        "--pooling",
        "-np --parallel",
        "-mmdev --mmproj-device",
        "--image-min-tokens",
        "--image-max-tokens",
        "--tags",
        "--embd-normalize",
        "--path",
        "--api-prefix",
        "--cors-origins",
        "--cors-methods",
        "--cors-headers",
        "--ui-config --webui-config",
        "--ui-config-file --webui-config-file",
        "--tools",
        "--mcp-servers-config",
        "--mcp-servers-json",
        "--ssl-key-file",
        "--ssl-cert-file",
        "-to --timeout",
        "--sse-ping-interval",
        "--threads-http",
        "--cache-reuse",
        "--media-path",
        "--models-max",
        "--reasoning-effort",
        "--reasoning-budget-message",
        "--chat-template",
        "--chat-template-file",
        "-sps --slot-prompt-similarity",
        "--sleep-idle-seconds",
        "--log-prompts-dir",
        "-td --threads-draft --spec-draft-threads",
        "-tbd --threads-batch-draft --spec-draft-threads-batch",
        "-Cd --cpu-mask-draft --spec-draft-cpu-mask",
        "-Crd --cpu-range-draft --spec-draft-cpu-range",
        "--cpu-strict-draft --spec-draft-cpu-strict",
        "--prio-draft --spec-draft-prio",
        "--poll-draft --spec-draft-poll",
        "-Cbd --cpu-mask-batch-draft --spec-draft-cpu-mask-batch",
        "-Crbd --cpu-range-batch-draft",
        "--cpu-strict-batch-draft --spec-draft-cpu-strict-batch",
        "--prio-batch-draft --spec-draft-prio-batch",
        "--poll-batch-draft --spec-draft-poll-batch",
        "-otd --override-tensor-draft --spec-draft-override-tensor",
        "-ncmoed --n-cpu-moe-draft --spec-draft-n-cpu-moe --spec-draft-ncmoe",
        "--spec-draft-n-min --draft-min --draft-n-min",
        "--spec-draft-p-split --draft-p-split",
        "--spec-draft-p-min --draft-p-min",
        "--spec-draft-sampling",
        "-devd --device-draft --spec-draft-device",
        "-ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-ngl",
        "-cd --ctx-size-draft",
        "--spec-ngram-size-n",
        "--spec-ngram-size-m",
        "--spec-ngram-min-hits",
        "--spec-ngram-mod-n-min",
        "--spec-ngram-mod-n-max",
        "--spec-ngram-mod-n-match",
        "--spec-ngram-simple-size-n",
        "--spec-ngram-simple-size-m",
        "--spec-ngram-simple-min-hits",
        "--spec-ngram-map-k-size-n",
        "--spec-ngram-map-k-size-m",
        "--spec-ngram-map-k-min-hits",
        "--spec-ngram-map-k4v-size-n",
        "--spec-ngram-map-k4v-size-m",
        "--spec-ngram-map-k4v-min-hits",
    ),
    "?": (
        "-fa --flash-attn",
        "-fit --fit",
        "--log-colors",
    ),
    2: ("--spec-replace",),
}

# features atlas does not have: the one line each is refused with
REFUSED: dict[str, str] = {
    "-md --model-draft --spec-draft-model": "atlas has no draft models: it drafts with the "
    "model's own MTP head (--spec-type draft-mtp, --spec-draft-n-max N)",
    "-hfd -hfrd --hf-repo-draft --spec-draft-hf": "atlas has no draft models: it drafts with "
    "the model's own MTP head (--spec-type draft-mtp, --spec-draft-n-max N)",
    "-mm --mmproj": "atlas runs text models only: it has no vision projector",
    "-mmu --mmproj-url": "atlas runs text models only: it has no vision projector",
    "--embedding --embeddings": "atlas serves no embedding models yet",
    "--rerank --reranking": "atlas serves no reranking models yet",
    "--lora": "atlas applies no LoRA adapters",
    "--lora-scaled": "atlas applies no LoRA adapters",
    "--control-vector": "atlas applies no control vectors",
    "--control-vector-scaled": "atlas applies no control vectors",
    "--control-vector-layer-range": "atlas applies no control vectors",
    "-mu --model-url": "atlas pulls models from Hugging Face: -hf ORG/REPO[:QUANT], or -m PATH",
    "-dr --docker-repo": "atlas pulls models from Hugging Face: -hf ORG/REPO[:QUANT], or -m PATH",
    "-hff --hf-file": "atlas picks a repository's GGUF by its quant: -hf ORG/REPO:QUANT",
    "--models-dir": "atlas-llama-server serves one model (-m or -hf): it has no router mode",
    "--models-preset": "atlas-llama-server serves one model (-m or -hf): it has no router mode",
    "-cl --cache-list": "atlas lists its models with `atlas list`",
}
REFUSED_NARGS = {"--control-vector-layer-range": 2}  # the others take one value
REFUSED_SWITCHES = {"--embedding --embeddings", "--rerank --reranking", "-cl --cache-list"}


class Ignored(argparse.Action):
    """A llama.cpp setting atlas has no use for: noted, as typed, for the one-line report."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None or isinstance(values, str):
            values = [] if values is None else [values]
        namespace.ignored.append(" ".join([option_string, *values]))


class Switch(argparse.Action):
    """A flag without a value that sets nothing in the namespace."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "nargs": 0, "dest": argparse.SUPPRESS})


class AlreadySo(Switch):
    """A llama-server switch that asks for what atlas always does (--jinja, --metrics)."""

    def __call__(self, parser, namespace, values, option_string=None):
        pass


class Refused(argparse.Action):
    """A feature atlas does not have: refused in one line saying what atlas does instead."""

    def __init__(self, *args, reason: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise UsageError(f"{option_string}: {self.reason}")


class PrintVersion(Switch):
    """llama-server's `version: N (commit)` line, which launchers such as Lemonade read."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"version: {__version__} (atlas)")
        print(f"built as {PROG}, atlas {__version__} on Python {sys.version.split()[0]}")
        parser.exit(0)


class ListDevices(Switch):
    """The GPUs atlas can see, named as llama.cpp names them for --device."""

    def __call__(self, parser, namespace, values, option_string=None):
        from atlas_cli import hardware

        print("Available devices:")
        for gpu in hardware.probe().gpus:
            kind = "CUDA" if gpu.vendor == "nvidia" else "ROCm"
            print(f"  {kind}{gpu.index}: {gpu.name} ({gpu.memory_bytes >> 20} MiB)")
        parser.exit(0)


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors, keeping every flag it declares (`flags`): a token that
    looks like a flag and is none of them is refused whole instead of split."""

    def __init__(self, *args, **kwargs):
        self.flags: set[str] = set()
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        self.flags.update(names)
        return super().add_argument(*names, **kwargs)

    def error(self, message):
        raise UsageError(message)


@functools.cache  # argparse parsers are reusable: built once, for each `parse`
def parser() -> OneLineParser:
    p = OneLineParser(
        prog=PROG,
        allow_abbrev=False,
        add_help=False,
        description="atlas serve behind llama-server's command line.",
        epilog="llama-server's other flags are accepted; those atlas has no use for are listed "
        "on stderr when the server starts.",
    )
    add = p.add_argument
    add("-h", "--help", "--usage", action="help", help="Show this help and exit.")
    add("--version", action=PrintVersion, help="Print the version and exit.")
    add("--list-devices", action=ListDevices, help="List the GPUs and exit.")
    declare_what_and_where(p)
    declare_how(p)
    declare_tables(p)
    return p


def declare_what_and_where(p: OneLineParser) -> None:
    """The model, the address, the device and the caches: the flags atlas reads."""
    add = p.add_argument
    add("-m", "--model", metavar="FILE", help="GGUF file (or an atlas model name) to serve.")
    add(
        "-hf",
        "-hfr",
        "--hf-repo",
        dest="hf_repo",
        metavar="ORG/REPO[:QUANT]",
        help="Pull this Hugging Face GGUF (as atlas pull hf.co/ORG/REPO:QUANT).",
    )
    add("-hft", "--hf-token", metavar="TOKEN", help="Hugging Face token (HF_TOKEN) for the pull.")
    add("--offline", action="store_true", help="Use only models already pulled.")
    add(
        "-a",
        "--alias",
        metavar="NAME",
        help="The model name the API reports (any name is answered).",
    )
    # where and how it runs
    add("--host", default="127.0.0.1", help="Address to listen on.")
    add("--port", type=int, default=8080, help="Port to listen on.")
    add("--api-key", metavar="KEY", help="Require this key.")
    add("--api-key-file", metavar="FILE", help="Require the key in this file (one line).")
    add(
        "-c",
        "--ctx-size",
        type=int,
        metavar="N",
        default=0,
        help="Context in tokens (0: the model's).",
    )
    add(
        "-dev",
        "--device",
        metavar="DEV[,DEV]",
        help="none (the CPU), CUDA0, ROCm0...: atlas's cpu, cuda, hip.",
    )
    add(
        "-mg",
        "--main-gpu",
        type=int,
        metavar="INDEX",
        help="The GPU to run on, counted as --device counts.",
    )
    add(
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
        dest="gpu_layers",
        metavar="N",
        help="0 runs on the CPU; atlas keeps any other count on the GPU whole.",
    )
    add("-t", "--threads", type=int, metavar="N", help="CPU threads (-1: all cores).")
    add(
        "-ctk",
        "--cache-type-k",
        metavar="TYPE",
        help="KV cache type (f16, bf16, f32, q8_0...): --kv-type.",
    )
    add(
        "-ctv",
        "--cache-type-v",
        metavar="TYPE",
        help="KV cache type of V: atlas has one type for K and V.",
    )
    add(
        "--cache-ram",
        "-cram",
        type=int,
        metavar="MiB",
        help="Prefix cache budget in MiB (0: none).",
    )
    add(
        "--slot-save-path",
        metavar="DIR",
        help="Where /slots save and restore keep files (none: both are refused).",
    )


def declare_how(p: OneLineParser) -> None:
    """Drafting, the template's thinking switch, sampling defaults and logs."""
    add = p.add_argument
    add(
        "--spec-type",
        metavar="TYPE",
        help="none, or draft-mtp: drafting with the model's MTP head.",
    )
    add(
        "--spec-draft-n-max",
        "--draft",
        "--draft-n",
        "--draft-max",
        type=int,
        dest="draft",
        metavar="N",
        help="Tokens the MTP head drafts per step.",
    )
    add("--jinja", action=AlreadySo, help="Accepted: atlas always uses the template.")
    add("--chat-template-kwargs", metavar="JSON", help="Template defaults as JSON.")
    add(
        "--reasoning-format",
        metavar="FORMAT",
        help="auto or deepseek: reasoning in reasoning_content.",
    )
    add(
        "-rea",
        "--reasoning",
        nargs="?",
        const="on",
        choices=("on", "off", "auto"),
        help="off asks the template not to think (enable_thinking).",
    )
    add("--reasoning-budget", type=int, metavar="N", help="0 asks the template not to think.")
    # sampling defaults, under each request's own
    add(
        "--temp",
        "--temperature",
        type=float,
        dest="temperature",
        metavar="N",
        help="Default temperature.",
    )
    add("--top-k", type=int, metavar="N", help="Default top-k.")
    add("--top-p", type=float, metavar="N", help="Default top-p.")
    add("--min-p", type=float, metavar="N", help="Default min-p.")
    add("--repeat-penalty", type=float, metavar="N", help="Default repeat penalty.")
    add("--presence-penalty", type=float, metavar="N", help="Default presence penalty.")
    add("-s", "--seed", type=int, metavar="N", help="Default seed (-1: random).")
    # endpoints and logs
    add("--metrics", action=AlreadySo, help="Accepted: atlas always serves /metrics.")
    add("--slots", action=AlreadySo, help="Accepted: atlas always serves /slots.")
    add("--no-ui", "--no-webui", action=AlreadySo, help="Accepted: atlas has no web UI.")
    add("--log-disable", action="store_true", help="Log warnings only.")
    add("-v", "--verbose", "--log-verbose", action="store_true", help="Log everything.")


def declare_tables(p: OneLineParser) -> None:
    """The flags of IGNORED and REFUSED, left out of --help."""
    add = p.add_argument
    for nargs, flags in IGNORED.items():
        for names in flags:
            add(
                *names.split(),
                nargs=None if nargs == 1 else nargs,
                action=Ignored,
                dest=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    for names, reason in REFUSED.items():
        nargs = 0 if names in REFUSED_SWITCHES else REFUSED_NARGS.get(names.split()[-1])
        add(
            *names.split(),
            nargs=nargs,
            action=Refused,
            reason=reason,
            dest=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def as_llama_reads(token: str) -> str:
    """llama.cpp's spelling rule: a long flag's underscores are dashes (`--ctx_size`)."""
    if not token.startswith("--"):
        return token
    name, eq, value = token.partition("=")
    return name.replace("_", "-") + eq + value


def looks_like_flag(token: str) -> bool:
    """What argparse would take for an option (and so might split into a short flag and its
    value): a dash and more, not a negative number, no space."""
    return (
        token.startswith("-")
        and len(token) > 1
        and not NEGATIVE_NUMBER.match(token)
        and " " not in token
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` read as llama-server reads it. The namespace's `ignored` lists the flags (with
    their values) atlas has no use for; a flag llama-server does not have, or a feature atlas
    does not have, is a one-line UsageError."""
    p = parser()
    argv = [as_llama_reads(t) if looks_like_flag(t) else t for t in argv]
    for token in argv:
        if looks_like_flag(token) and token.partition("=")[0] not in p.flags:
            raise UsageError(f"invalid argument: {token} (not a llama-server flag)")
    return p.parse_args(argv, namespace=argparse.Namespace(ignored=[]))
