"""``jaxtune`` command line: parses arguments and calls library functions, nothing more.

    jaxtune train CONFIG [key=value ...]
    jaxtune eval RUN_DIR|MODEL_DIR|CONFIG [key=value ...] [--data test.jsonl]
    jaxtune generate RUN_DIR --prompt TEXT [--prompt TEXT ...] [--chat] [--truncate left]
    jaxtune info CONFIG [key=value ...] [--compile-for v5e-8 [--max-batch] [--max-seq]] [--json]
    jaxtune export RUN_DIR OUT_DIR [--dtype bfloat16] [--adapter]
    jaxtune export RUN_DIR OUT.gguf --gguf [--gguf-type f16|bf16|q8_0|f32]
    jaxtune parity HF_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from jaxtune import runtime
from jaxtune.config.kinds import FAMILY_NAMES, GGUF_TYPES


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a command reports as one ``error:`` line (exit 2): bad input, not a bug. Imported here, not at
    the top, so that the CLI answers before JAX and the data stack have loaded."""
    from jaxtune.config import ConfigError
    from jaxtune.data import DataError
    from jaxtune.io import CheckpointError, OutputError
    from jaxtune.job.distributed import HostError
    from jaxtune.job.run_dir import RunDirError
    from jaxtune.models.sampling import PromptError
    from jaxtune.models.unsupported import UnsupportedModelError
    from jaxtune.rollout.rewards import RewardError
    from jaxtune.sharding import ShardingError

    return (ConfigError, DataError, ShardingError, CheckpointError, UnsupportedModelError, PromptError,
            FileNotFoundError, FileExistsError, RunDirError, RewardError, OutputError, HostError)


def _train(args: argparse.Namespace) -> int:
    print(f"jaxtune train {args.config}: starting", flush=True)  # at once: the imports below take seconds
    from jaxtune.config import load_config
    from jaxtune.loop import NonFiniteLossError, train

    try:
        train(load_config(args.config, args.overrides))
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _eval(args: argparse.Namespace) -> int:
    from jaxtune.evaluate import evaluate

    overrides = list(args.overrides)
    model_dir = Path(args.target).expanduser()
    given = any(o.startswith("data.format=") for o in overrides)
    if args.data and not given and not (model_dir / "config.yaml").is_file():
        from jaxtune.data import detect_format  # a model directory has no data.format of its own

        overrides.append(f"data.format={detect_format(args.data)}")
    result = evaluate(args.target, overrides, batches=args.batches, data=args.data, reference=args.reference)
    print(json.dumps(result))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jaxtune.config import ConfigError
    from jaxtune.generate import sample
    from jaxtune.run import load_run

    run = load_run(args.run_dir)
    tok = run.tokenizer
    if run.cfg.objective.spec.head == "score":
        raise ConfigError(f"{args.run_dir} is a reward model (a score head, no language-model head): it scores "
                          "sequences and generates none; generate with a language model")
    if args.chat and tok.chat_template is None:
        raise ConfigError(f"{args.run_dir}: the tokenizer has no chat template, so --chat cannot format prompts")
    if args.chat is None:  # a run fine-tuned on chat data is asked as it was trained: a prompt is a user turn
        args.chat = run.chat
        if args.chat:
            print(f"{args.run_dir} was trained on chat data: each prompt is a user turn (--no-chat: raw text)",
                  file=sys.stderr)
        elif tok.chat_template is not None:
            print("note: the model has a chat template; --chat makes each prompt a user turn", file=sys.stderr)
    gen = run.spec.generator()
    prompts = [p.encode().decode("unicode_escape") if args.escapes else p for p in args.prompt]
    echo = len(prompts) == 1 and not args.chat  # the prompt, then its continuation as it is produced
    streamed: list[int] = []

    def stream(ids):  # first called once the prompts passed their checks: nothing is echoed before an error
        nonlocal echo
        if echo:
            sys.stdout.write(prompts[0])
            echo = False
        if ids[0] >= 0:
            before = tok.decode(streamed)
            streamed.append(int(ids[0]))
            sys.stdout.write(tok.decode(streamed)[len(before):])
            sys.stdout.flush()

    outs = sample(gen, run.weights, tok, prompts, chat=args.chat, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  truncate=args.truncate, on_step=stream if len(prompts) == 1 else None)
    if echo:  # no step ran (--max-new-tokens 0)
        sys.stdout.write(prompts[0])
    if len(prompts) == 1:
        print()
    else:
        for p, ids in zip(prompts, outs):
            print(f"--- {p!r}\n{'' if args.chat else p}{tok.decode(ids)}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from jaxtune.config import ConfigError, load_config
    from jaxtune.info import format_info, info

    mesh = []
    for part in filter(None, (args.mesh or "").split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in ("data", "fsdp", "tensor", "context") or not value:
            raise ConfigError(f"--mesh {args.mesh!r}: expected e.g. data=2,fsdp=4,tensor=1 (or context=2)")
        mesh.append(f"mesh.{key.strip()}={value}")
    for flag, given in (("--max-batch", args.max_batch), ("--max-seq", args.max_seq)):
        if given and not args.compile_for:
            raise ConfigError(f"{flag} searches by compiling for a TPU slice; add --compile-for SLICE (e.g. v5e-8)")
    target, *more = args.compile_for or [None]  # key=value overrides may follow the slice name
    if any("=" not in o for o in more):
        raise ConfigError(f"--compile-for {' '.join(args.compile_for)}: give one slice name, then key=value overrides")
    cfg = load_config(args.config, [*args.overrides, *more, *mesh])
    report: dict = {}
    if target:
        from jaxtune.aot import format_plan, plan, tpu_slice

        devices = tpu_slice(target).chips  # a bad name fails before anything is built
        report["compiled"] = plan(cfg, target, args.search_seconds if args.max_batch else 0.0,
                                  args.search_seconds if args.max_seq else 0.0)
    else:
        devices = args.devices
    report["info"] = info(cfg, devices=devices)
    if args.json:
        print(json.dumps(report, default=str, indent=1))  # the model's config as its repr
    else:
        print(format_info(report["info"]))
        if "compiled" in report:
            print(format_plan(report["compiled"]))
    return 0


def _export(args: argparse.Namespace) -> int:
    from jaxtune.config import ConfigError
    from jaxtune.export import export

    if args.gguf_type and not args.gguf:
        raise ConfigError("--gguf-type applies to a GGUF export; add --gguf")
    out = export(args.run_dir, args.out_dir, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1e9),
                 overwrite=args.overwrite, adapter=args.adapter, gguf=(args.gguf_type or "f16") if args.gguf else None)
    classifier = not args.adapter and not args.gguf and "ForSequenceClassification" in (out / "config.json").read_text()
    how = ("peft.PeftModel.from_pretrained(base_model, OUT_DIR)" if args.adapter
           else "llama.cpp, Ollama, or transformers' gguf_file=" if args.gguf
           else "transformers.AutoModelForSequenceClassification.from_pretrained" if classifier
           else "transformers.AutoModelForCausalLM.from_pretrained")
    print(f"exported {args.run_dir} to {out} (load with {how})")
    return 0


def _tools(args: argparse.Namespace) -> int:
    from jaxtune.config import ConfigError
    from jaxtune.tool_trial import try_tools

    fields = {}
    for given in args.field:
        key, sep, value = given.partition("=")
        if not sep or not key:
            raise ConfigError(f"--field {given!r}: expected NAME=VALUE (the value JSON, or text)")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    trial = try_tools(args.config, args.overrides, args.turn, prompt=args.prompt, row=args.row, fields=fields,
                      module=args.tools, timeout=args.timeout)
    print("\n".join(trial.lines()))
    return 0


def _parity(args: argparse.Namespace) -> int:
    from jaxtune.parity import parity

    report = parity(args.hf_dir, batch=args.batch, seq=args.seq, new_tokens=args.new_tokens,
                    tolerance=args.tolerance, seed=args.seed, backend=args.backend)
    print(report.format())
    return 0 if report.ok else 1


def _train_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train or resume the run a config describes")
    p.add_argument("config", help="YAML file, or a shipped config name (quickstart, gpt2-124m, ...)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100")
    p.set_defaults(fn=_train)


def _eval_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out loss/perplexity of a run's latest checkpoint or of a model directory")
    p.add_argument("target", help="run directory, HuggingFace model directory (e.g. an export), .gguf file or config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--data", help="test set (file, glob or hf:NAME) in the run's data.format; a model directory's "
                   "format is read from the first row unless data.format=... is given")
    p.add_argument("--batches", type=int, default=None, help="batches (default: eval.batches, or all of --data)")
    p.add_argument("--reference", help="DPO, KTO: the reference model directory to score against (required for a model "
                   "directory, e.g. the model it was trained from; a run's own is its starting weights)")
    p.set_defaults(fn=_eval)


def _generate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--escapes", action="store_true", help=r"interpret \n and \t in prompts")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="each prompt is a user turn, formatted by the chat template; generation stops at the end of "
                   "the assistant's turn (default: on for a run fine-tuned on chat data, off otherwise)")
    p.add_argument("--truncate", choices=["left"], default=None, help="left: a prompt that leaves no room for "
                   "--max-new-tokens in the context keeps its last tokens (default: a prompt as long as the context "
                   "is an error, and fewer new tokens are made)")
    p.set_defaults(fn=_generate)


def _info_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="parameters, FLOPs per token and memory per device for a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--mesh", help="mesh sizes, e.g. data=2,fsdp=4,tensor=1 or fsdp=2,context=4 (one may be -1)")
    p.add_argument("--devices", type=int, help="plan for this many devices instead of this host's")
    p.add_argument("--compile-for", nargs="+", metavar="SLICE", help="compile the real train step for a Cloud TPU "
                   "slice on this machine (v5e-8, v5litepod-8, v5p-128, v6e-256, v4-8; needs pip install "
                   "'jaxtune[aot]'): memory per chip and whether it fits, FLOPs, collectives, a roofline step time and "
                   "MFU")
    p.add_argument("--max-batch", action="store_true", help="with --compile-for: also search the largest global "
                   "batch that fits, compiling each candidate")
    p.add_argument("--max-seq", action="store_true", help="with --compile-for: also search the longest sequence "
                   "(data.seq_len; GRPO: the longest completion) that fits at train.batch_size, up to the model's "
                   "context, compiling each candidate (mesh.context splits sequences)")
    p.add_argument("--search-seconds", type=float, default=900.0, help="each search's compile time budget "
                   "(default 900)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=_info)


def _export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's latest checkpoint as a HuggingFace model directory, or as a GGUF "
                       "file (--gguf)")
    p.add_argument("run_dir")
    p.add_argument("out_dir", help="the directory to write, or with --gguf the .gguf file")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: the params' dtype)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size, in GB")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR (refused when it "
                   "holds other files), or the .gguf file")
    p.add_argument("--adapter", action="store_true", help="LoRA runs: write a PEFT adapter instead of the merged model")
    p.add_argument("--gguf", action="store_true", help="write one llama.cpp/Ollama GGUF file (OUT.gguf) instead: "
                   f"{', '.join(FAMILY_NAMES)} models with BPE tokenizers; a LoRA run is merged first")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                   help="with --gguf: the matrices' type (default f16; norms and biases stay f32)")
    p.set_defaults(fn=_export)


def _parity_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare the native model with transformers on a HuggingFace checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared (0: logits only)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max relative logit error that passes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["native", "torchax"], default="native",
                   help="torchax: also run the transformers model through torchax (native vs torchax vs eager)")
    p.set_defaults(fn=_parity)


# Each subcommand's arguments, in the order ``jaxtune --help`` lists them; each sets ``fn``, the function it runs.
def _tools_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tools", help="try a tools module on scripted model turns: what the model reads back, and "
                       "what a run counts, without a model")
    p.add_argument("config", help="YAML file, shipped config name or run directory: its tokenizer, chat template and "
                   "tools (objective.tools, or data.tools)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--turn", action="append", default=[], help="the model's turn, as text in the template's tool-call "
                   "format (e.g. <tool_call>{...}</tool_call>); once per turn, in order")
    p.add_argument("--prompt", help="a user message as the prompt (default: the config's prompt row --row)")
    p.add_argument("--row", type=int, default=0, help="which row of the config's prompt data is the prompt")
    p.add_argument("--field", action="append", default=[], help="with --prompt: a row field NAME=VALUE handed to an "
                   "environment's reset()")
    p.add_argument("--tools", help="the tools module (default: the config's objective.tools, else data.tools)")
    p.add_argument("--timeout", type=float, help="seconds a tool call may take (default: objective.tool_timeout)")
    p.set_defaults(fn=_tools)


COMMANDS = (_train_command, _eval_command, _generate_command, _info_command, _export_command, _parity_command,
            _tools_command)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's arguments; key=value overrides after an option (jaxtune eval M --data F
    objective.name=dpo) are overrides too."""
    parser = argparse.ArgumentParser(prog="jaxtune", description="Train language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command(sub)
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runtime.tune_malloc()  # before JAX allocates: see jaxtune.runtime
    runtime.quiet_libtpu()  # before JAX loads libtpu
    try:
        return args.fn(args)
    except user_errors() as e:
        # on a terminal, a progress bar may be mid-line: the error line replaces it rather than being glued to it
        print(("\r\x1b[K" if sys.stderr.isatty() else "") + f"error: {e}", file=sys.stderr)
        # a write the error abandoned (Orbax's async fragment on a full disk) would be reported as a coroutine never
        # awaited as the process exits, after the one line the user is owed
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        return 2
    except KeyboardInterrupt:  # before the training loop (which saves and exits 0 on the first Ctrl-C)
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
