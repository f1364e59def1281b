"""Tokenizing a TinyStories-like corpus: jaxtune's `prepare_tokens` (worker processes, sharded cache) against the same
tokenizer's single-thread ``encode_batch_fast`` on the same text, with peak memory and time to first output.

    python benchmarks/tokenizing.py --gb 0.2            # stories separated by <|endoftext|>
    python benchmarks/tokenizing.py --gb 0.2 --single-doc  # the same text with no separator: one document
    python benchmarks/tokenizing.py --tiny              # seconds: a 2 MB corpus, a 512-token BPE

jaxtune runs in a child process (a fresh cache each time) whose tree (the workers included) is sampled every 50 ms
for RSS and PSS (PSS splits pages the processes share, such as the tokenizer library, so it adds up); the baseline
runs in another child with ``TOKENIZERS_PARALLELISM=false`` on (at most) the first ``--baseline-mb`` of the text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import print_header, run_record

_NAMES = ["Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Sue", "Tim", "Lucy", "Jack", "Emma"]
_WORDS = ["the", "a", "little", "big", "happy", "sad", "dog", "cat", "ball", "tree", "park", "sun", "mom", "dad",
          "friend", "toy", "red", "blue", "green", "played", "ran", "jumped", "saw", "found", "wanted", "liked", "said",
          "looked", "went", "came", "gave", "made", "took", "smiled", "laughed", "and", "but", "so", "then", "because",
          "very", "too", "with", "in", "on", "under", "near", "to", "of", "for", "day", "time", "house", "garden",
          "bird", "fish", "box", "cake", "flower", "car", "boat", "hat", "shoe", "star", "moon", "water", "sky", "rain",
          "wind"]


def story(rng: random.Random) -> str:
    """One short story, about 0.8 kB: TinyStories' shape (simple words, short sentences, paragraphs)."""
    out = [f"Once upon a time, there was a {rng.choice(_WORDS)} named {rng.choice(_NAMES)}."]
    for _ in range(rng.randint(5, 14)):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14)))
        out.append(f"{rng.choice(_NAMES)} {words}{rng.choice('.!?.')}")
        if rng.random() < 0.2:
            out.append("\n\n")
    return " ".join(out)


def write_corpus(path: Path, size: int, single_doc: bool, seed: int = 0) -> None:
    rng = random.Random(seed)
    sep = "\n\n" if single_doc else "\n<|endoftext|>\n"
    done = 0
    with path.open("w") as f:
        while done < size:
            chunk = "".join(story(rng) + sep for _ in range(1000))
            f.write(chunk)
            done += len(chunk)


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes of ``pid`` and its descendants."""
    rss = pss = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return rss, pss


def run_sampled(cmd: list[str], env: dict[str, str]) -> dict:
    """Run ``cmd``; wall seconds, seconds to its first stderr byte, peak tree RSS/PSS, and its stdout (JSON)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    os.set_blocking(proc.stderr.fileno(), False)
    first, peak_rss, peak_pss, err = None, 0, 0, b""
    while proc.poll() is None:
        chunk = proc.stderr.read() or b""
        if chunk and first is None:
            first = time.perf_counter() - t0
        err += chunk
        rss, pss = tree_memory(proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out = proc.stdout.read()
    err += proc.stderr.read() or b""
    if proc.returncode:
        sys.exit(f"{cmd[:3]} failed:\n{err.decode()[-3000:]}")
    return {"wall_s": wall, "first_output_s": first, "peak_rss": peak_rss, "peak_pss": peak_pss,
            "result": json.loads(out.decode().strip().splitlines()[-1]), "stderr": err.decode()}


_JAXTUNE = """
import json, sys, time
from jaxtune.config import DataConfig
from jaxtune.data import load_tokenizer_dir, prepare_tokens
cfg = DataConfig(sources=[sys.argv[1]], cache_dir=sys.argv[2], num_proc=int(sys.argv[4]) or None, seq_len=64)
t = time.perf_counter()
data = prepare_tokens(cfg, load_tokenizer_dir(sys.argv[3]))
print(json.dumps({"tokens": len(data.tokens), "tokenize_s": time.perf_counter() - t}))
"""

_BASELINE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
tok.encode_special_tokens = True
text = open(sys.argv[2], encoding="utf-8").read(int(sys.argv[3]))
docs = [d.strip() for d in text.split("<|endoftext|>")] if "<|endoftext|>" in text else text.split("\\n\\n")
t = time.perf_counter()
n = 0
for i in range(0, len(docs), 1024):
    n += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i : i + 1024], add_special_tokens=False))
print(json.dumps({"bytes": len(text.encode()), "tokens": n, "seconds": time.perf_counter() - t}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[0.05], help="corpus sizes in GB (default 0.05)")
    ap.add_argument("--single-doc", action="store_true", help="no separators: the corpus is one document")
    ap.add_argument("--tiny", action="store_true", help="a 2 MB corpus and a 512-token BPE: finishes in seconds")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--num-proc", type=int, default=0, help="data.num_proc (default: all cores)")
    ap.add_argument("--baseline-mb", type=float, default=50, help="text the single-thread baseline encodes")
    ap.add_argument("--workdir", help="where the corpora and caches go (default: a temporary directory)")
    ap.add_argument("--json", help="also write the table and run details to this path")
    args = ap.parse_args()
    sizes = [0.002] if args.tiny else args.gb
    vocab = 512 if args.tiny else args.vocab
    work = Path(args.workdir or tempfile.mkdtemp(prefix="jaxtune-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # The tokenizer: a byte-level BPE trained by jaxtune on a sample of the same kind of text (not timed).
    sample = work / "sample.txt"
    write_corpus(sample, min(5_000_000, int(sizes[0] * 1e9)), single_doc=False, seed=1)
    tok_dir = work / f"bpe-{vocab}"
    if not (tok_dir / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-c", (
            "import sys; from jaxtune.config import DataConfig, TokenizerConfig; "
            "from jaxtune.data import load_tokenizer; "
            f"load_tokenizer(TokenizerConfig(vocab_size={vocab}, train_bytes=5_000_000), "
            "DataConfig(sources=[sys.argv[1]], cache_dir=sys.argv[2])).save(__import__('pathlib').Path(sys.argv[3]))"),
            str(sample), str(work / "cache-bpe"), str(tok_dir)], check=True, env=env, stderr=subprocess.DEVNULL)

    rows = []
    for gb in sizes:
        corpus = work / f"corpus-{gb}gb{'-single' if args.single_doc else ''}.txt"
        if not corpus.is_file():
            write_corpus(corpus, int(gb * 1e9), args.single_doc)
        size = corpus.stat().st_size
        base = run_sampled([sys.executable, "-c", _BASELINE, str(tok_dir), str(corpus),
                            str(int(args.baseline_mb * 1e6))], {**env, "TOKENIZERS_PARALLELISM": "false"})
        base_mbs = base["result"]["bytes"] / base["result"]["seconds"] / 1e6
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        ours = run_sampled([sys.executable, "-c", _JAXTUNE, str(corpus), str(cache), str(tok_dir),
                            str(args.num_proc)], env)
        ours_mbs = size / ours["result"]["tokenize_s"] / 1e6
        rows.append({"corpus": f"{size / 1e9:.3g} GB{' one doc' if args.single_doc else ''}", "bytes": size,
                     "tokens": ours["result"]["tokens"], "baseline_mb_s": base_mbs, "jaxtune_mb_s": ours_mbs,
                     "speedup": ours_mbs / base_mbs, "wall_s": ours["wall_s"],
                     "first_output_s": ours["first_output_s"], "peak_rss_mb": ours["peak_rss"] / 1e6,
                     "peak_pss_mb": ours["peak_pss"] / 1e6})
        for f in cache.rglob("*"):
            if f.is_file():
                f.unlink()

    record = run_record()
    cores = len(os.sched_getaffinity(0))
    print(f"\n{record['machine']['cpu']}, {cores} cores usable; load average {os.getloadavg()[0]:.1f}; "
          f"BPE vocab {vocab}; data.num_proc={args.num_proc or 'all'}")
    head = ["corpus", "1-thread encode_batch_fast MB/s", "jaxtune MB/s", "× 1 thread", "wall s",
            "first output s", "peak RSS MB", "peak PSS MB"]
    print_header(head)
    for r in rows:
        print(f"| {r['corpus']} | {r['baseline_mb_s']:.2f} | {r['jaxtune_mb_s']:.2f} | {r['speedup']:.2f} | "
              f"{r['wall_s']:.1f} | {r['first_output_s'] or float('nan'):.2f} | {r['peak_rss_mb']:.0f} | "
              f"{r['peak_pss_mb']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**record, "cores": cores, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
