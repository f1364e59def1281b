"""A run's plan on a TPU slice from its compiled step (`jaxtune.aot.step`): the roofline step time, MFU and tokens/s
(`roofline`), the plan's numbers (`plan`, with the searches of `jaxtune.aot.search` when asked) and its text
(`format_plan`)."""

from __future__ import annotations

from typing import Any

from jaxtune import sharding
from jaxtune.aot.catalog import GiB
from jaxtune.aot.reward_models import compile_reward_models
from jaxtune.aot.sampler import compile_sampler, step_estimate
from jaxtune.aot.search import largest_batch, longest_sequence, sequence_room
from jaxtune.aot.step import Program, program
from jaxtune.config import Config


def roofline(p: Program, compiled: dict[str, Any]) -> dict[str, Any]:
    """Step time as the slowest of compute, HBM traffic and ICI traffic at the chip's peak rates (no overlap
    modelled beyond taking the maximum), MFU against the analytic model FLOPs, tokens/s."""
    chip, hlo, b = p.slice.chip, compiled["hlo"], compiled["batch_size"]
    # a pair trains 2 sequences, a GRPO prompt num_generations; sharing its prompt, a row holds it once
    c = p.cfg
    tokens = c.data.kind.trained_positions(b, c.data.seq_len, c.objective, c.data.shares_prompts)
    model_flops = p.steps.spec.model_cfg.flops_per_token(p.cfg.data.seq_len) * tokens
    # Pallas kernels (model.attention=splash) hide their matmuls from the HLO: the model's FLOPs stand in
    flops = max(hlo.flops, model_flops / p.slice.chips) if hlo.kernels else hlo.flops
    times = {"compute": flops / chip.peak_flops, "HBM": hlo.bytes / chip.hbm_bw,
             "ICI": hlo.ici_bytes / chip.ici_axis_bw}
    bound = max(times, key=times.get)
    step = times[bound]
    return {"seconds": times, "step_seconds": step, "bound": bound, "model_flops": model_flops,
            "mfu": model_flops / (p.slice.chips * step * chip.peak_flops) if step else None,
            "tokens_per_second": tokens / step if step else None, "kernels": hlo.kernels}


def plan(cfg: Config, target: str, search_seconds: float = 0.0, seq_seconds: float = 0.0) -> dict[str, Any]:
    """``cfg``'s train step compiled for the slice ``target`` at train.batch_size: memory per chip and whether it
    fits, FLOPs, HBM and collective bytes per chip and step, the roofline (when it compiled), and with
    ``search_seconds`` > 0 the largest batch that fits (`largest_batch`), with ``seq_seconds`` > 0 the longest
    sequence (`longest_sequence`)."""
    p = program(cfg, target)
    if seq_seconds > 0:
        sequence_room(p)  # a context the search cannot step into is refused before the first compile
    b, unit = p.cfg.train.batch_size, p.batch_unit
    if b % unit:
        raise sharding.ShardingError(
            f"train.batch_size={b}: on {p.slice.name} it must be a multiple of {unit} (the data-parallel degree "
            f"{p.data_parallel} x train.micro_batches {p.cfg.train.micro_batches}), e.g. {max(b // unit, 1) * unit}")
    r = p.compile(b)
    chip = p.slice.chip
    out: dict[str, Any] = {
        "slice": {"name": p.slice.name, "chips": p.slice.chips, "topology": p.slice.topology,
                  "device_kind": p.mesh.devices.flat[0].device_kind, "peak_flops": chip.peak_flops, "hbm": chip.hbm,
                  "hbm_usable": chip.hbm_usable, "hbm_bw": chip.hbm_bw, "ici_bw": chip.ici_bw,
                  "ici_axis_bw": chip.ici_axis_bw, "source": chip.source},
        "mesh": dict(p.mesh.shape), "batch_size": b, "sequences": p.sequences, "unit": p.cfg.data.kind.unit,
        "seq_len": p.cfg.data.seq_len,
        "micro_batches": p.cfg.train.micro_batches, "fits": r["fits"], "memory": r["memory"],
        "compile_seconds": r["compile_seconds"], "note": p.note,
    }
    total = r["memory"]["total"]
    if total is not None:
        out["headroom"] = chip.hbm_usable - total
    if "compiler" in r:
        out["compiler"] = r["compiler"]
    if "hlo" in r:
        hlo = r["hlo"]
        out.update(flops_per_chip=hlo.flops, hbm_bytes_per_chip=hlo.bytes, collective_bytes=hlo.collective_bytes,
                   ici_bytes=hlo.ici_bytes, loops=hlo.loops, loops_unknown=hlo.loops_unknown, xla_cost=r["xla_cost"],
                   roofline=roofline(p, r))
    if p.cfg.objective.generates:  # GRPO: the sampler beside the train step, and the step split between them
        out["sampler"] = compile_sampler(p)
        if "skipped" not in out["sampler"]:
            out["estimate"] = step_estimate(p, out["sampler"], out.get("roofline"))
        out["reward_models"] = compile_reward_models(p)
    if search_seconds > 0:
        out["largest_batch"] = largest_batch(p, r, search_seconds)
    if seq_seconds > 0:
        out["longest_sequence"] = longest_sequence(p, seq_seconds)
    return out


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def format_plan(d: dict[str, Any]) -> str:
    s, m = d["slice"], d["memory"]
    usable = s["hbm_usable"]
    micro = f" in {d['micro_batches']} micro-batches" if d["micro_batches"] > 1 else ""
    n = d.get("sequences", 1)
    batch = f"{d['batch_size']} {d['unit']} x {n} sequences" if n > 1 else f"{d['batch_size']}"
    head = (f"compiled for:     {s['name']}: {s['chips']} chips of {s['device_kind']} (topology {s['topology']}), "
            f"mesh {d['mesh']}, batch {batch} x {d['seq_len']} tokens{micro}; compiled in "
            f"{d['compile_seconds']:.0f} s")
    lines = [head]
    if d["fits"]:
        lines.append(f"memory / chip:    arguments {_gib(m['arguments'])}, outputs {_gib(m['outputs'])} "
                     f"({_gib(m['aliased'])} of them in donated arguments), temporaries {_gib(m['temporaries'])}, "
                     f"code {_gib(m['code'])}: {_gib(m['total'])} of {_gib(usable)} usable HBM: fits, "
                     f"{_gib(d['headroom'])} ({100 * d['headroom'] / usable:.1f}%) free"
                     + (f"; and {_gib(m['host'])} of the host's memory (model.remat=offload)" if m.get("host") else ""))
    elif "state_and_frozen" not in m:  # compiled, but more than the chip's usable HBM in all
        over = m["total"] - usable
        lines.append(f"memory / chip:    does not fit: arguments {_gib(m['arguments'])}, temporaries "
                     f"{_gib(m['temporaries'])}, code {_gib(m['code'])}: {_gib(m['total'])} of {_gib(usable)} "
                     f"usable HBM: over by {_gib(over)} ({100 * over / usable:.0f}%)")
    elif m["total"] is not None:
        over = m["total"] - usable
        lines.append(f"memory / chip:    does not fit: at least {_gib(m['total'])} (the compiler's "
                     f"{_gib(m['temporaries'])} of temporaries + {_gib(m['state_and_frozen'])} of state and frozen "
                     f"weights) of {_gib(usable)} usable HBM: over by {_gib(over)} ({100 * over / usable:.0f}%)")
    else:
        lines.append(f"memory / chip:    does not fit: {d['compiler']}")
    if "roofline" in d:
        rl, t = d["roofline"], d["roofline"]["seconds"]
        moved = ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in d["collective_bytes"].items() if v) or "none"
        unknown = (f"; {d['loops_unknown']} of {d['loops']} loops have no readable trip count and count once"
                   if d["loops_unknown"] else "")
        lines.append(f"FLOPs / chip:     {d['flops_per_chip']:.3e} per step (the HLO's matmuls, loop bodies x trip "
                     f"count; XLA's cost analysis, which counts a loop body once: {d['xla_cost']['flops'] or 0:.3e})")
        lines.append(f"HBM bytes / chip: {d['hbm_bytes_per_chip']:.3e} per step (read and written by top-level ops)")
        lines.append(f"collectives:      {moved} per chip and step; {d['ici_bytes'] / 1e6:,.1f} MB through each "
                     f"chip's ICI links in ring algorithms{unknown}")
        if rl.get("kernels"):
            lines.append(f"kernels:          {rl['kernels']} Pallas kernel calls a step, whose matmuls the HLO does "
                         f"not show: the compute time is the model's FLOPs at peak (an upper bound on MFU, not a "
                         f"measurement)")
        lines.append(f"roofline:         compute {1e3 * t['compute']:.1f} ms, HBM {1e3 * t['HBM']:.1f} ms, ICI "
                     f"{1e3 * t['ICI']:.1f} ms: {1e3 * rl['step_seconds']:.1f} ms per step ({rl['bound']}-bound); "
                     f"MFU {100 * rl['mfu']:.1f}% (model FLOPs {rl['model_flops']:.3e}), "
                     f"{rl['tokens_per_second']:,.0f} tokens/s")
    if "sampler" in d:
        lines += _sampler_lines(d)
    lines += _reward_model_lines(d)
    if "largest_batch" in d:
        lb = d["largest_batch"]
        found = f"{lb['batch_size']} fits" if lb["batch_size"] else f"none fits (not even {lb['unit']})"
        refused = f", {lb['refused']} does not" if lb["refused"] else ", no refusal found yet"
        budget = "" if lb["exact"] else "; stopped by the time budget"
        lines.append(f"largest batch:    {found}{refused} (multiples of {lb['unit']}; {lb['compiles']} compiles, "
                     f"{lb['compile_seconds']:.0f} s{budget})")
    if "longest_sequence" in d:
        lines.append(_longest_line(d["longest_sequence"]))
    return "\n".join(lines)


def _reward_model_lines(d: dict[str, Any]) -> list[str]:
    """One line per reward model: its program's shapes, and memory per chip beside the resident training state."""
    usable, lines = d["slice"]["hbm_usable"], []
    for rm in d.get("reward_models", []):
        pm = rm["program"]
        verdict = "fits" if rm["fits"] else f"does not fit (over by {_gib(rm['total'] - usable)})"
        lines.append(f"reward model:     {rm['key']} ({rm['path']}, {rm['params'] / 1e6:,.1f}M parameters): "
                     f"{rm['rows']} sequences of {rm['width']} positions a call, one program compiled in "
                     f"{rm['compile_seconds']:.0f} s; weights {_gib(rm['weights'])} / chip, temporaries "
                     f"{_gib(pm['temporaries'])}, code {_gib(pm['code'])}; with the training state resident "
                     f"({_gib(rm['resident'])}): {_gib(rm['total'])} of {_gib(usable)} usable HBM: {verdict}")
    return lines


def _sampler_lines(d: dict[str, Any]) -> list[str]:
    """GRPO's sampler: its shapes and memory per chip beside the resident training state, and the step estimate."""
    sp = d["sampler"]
    if "skipped" in sp:
        return [f"sampler:          {sp['skipped']}"]
    usable, pm = d["slice"]["hbm_usable"], sp["program"]
    verdict = "fits" if sp["fits"] else f"does not fit (over by {_gib(sp['total'] - usable)})"
    lines = [(f"sampler:          {sp['prompts']} prompts x {sp['group']} completions, prompts of "
              f"{sp['prompt_len']} positions (each prefilled once for its group), KV cache of {sp['cache_len']} "
              f"positions, at most {sp['max_new_tokens']} new tokens; one program (prefill and decode loop) compiled "
              f"in {sp['compile_seconds']:.0f} s"),
             f"sampler / chip:   weights {_gib(sp['weights'])}"
             + (f" (LoRA merged: {_gib(sp['merged_kernels'])} of adapted kernels computed anew)"
                if sp["lora_merged"] else "")
             + f", KV cache {_gib(sp['kv_cache'])} ({sp['kv_dtype']}"
             + (", on chip" if sp["kv_on_chip"] else "") + f"), temporaries {_gib(pm['temporaries'])}, "
             f"outputs {_gib(pm['outputs'])}, code {_gib(pm['code'])}; with the training state resident "
             f"({_gib(sp['resident'])}): {_gib(sp['total'])} of {_gib(usable)} usable HBM: {verdict}"]
    if "estimate" in d:
        e = d["estimate"]
        passes = f" x {e['passes']} passes" if e["passes"] > 1 else ""
        line = (f"step estimate:    generation {e['generation']:.2f} s (prefill {1e3 * e['prefill']:.1f} ms at "
                f"{100 * e['mfu_assumed']:.0f}% MFU; decode {sp['max_new_tokens']} positions x "
                f"{e['decode_bytes_per_token'] / 1e6:,.1f} MB read per chip (weights and the full KV cache) / HBM "
                f"bandwidth = {e['decode']:.2f} s, memory-bound)")
        if "step" in e:
            line += (f"; training {e['training_roofline']:.2f} s (roofline{passes}), {e['training_at_mfu']:.2f} s "
                     f"at {100 * e['mfu_assumed']:.0f}% MFU; about {e['step']:.2f} s per step, "
                     f"{100 * e['generation'] / e['step']:.0f}% of it generating")
        lines.append(line)
        if "overlap" in e:
            lines.append(_overlap_line(e))
    return lines


def _overlap_line(e: dict[str, Any]) -> str:
    """``objective.max_staleness``'s step beside the sequential one (`jaxtune.aot.sampler.overlapped`)."""
    o = e["overlap"]
    head = f"sampled ahead:    objective.max_staleness={o['max_staleness']}"
    if "refused" in o:
        return f"{head}: {o['refused']}"
    if not o["rollout_chips"]:
        return (f"{head} on the learner's chips: the device time stays about {e['step']:.2f} s per step; what "
                "overlaps is the host's (rewards, tools, layout). mesh.rollout gives the sampler chips of its own")
    r = o["rollout_chips"]
    return (f"{head}, mesh.rollout={r}: generation {o['generation']:.2f} s on {r} chips (weights whole on each), "
            f"training {o['training']:.2f} s on the rest (both scaled from the slice's programs): about "
            f"{o['step']:.2f} s per step against {e['step']:.2f} s sequential ({e['step'] / o['step']:.2f}x)")


def _longest_line(ls: dict[str, Any]) -> str:
    what = (f"longest completion: after prompts of {ls['prompt_tokens']} tokens, " if ls["completion"]
            else "longest sequence: ")
    found = f"{ls['tokens']:,} tokens fit" if ls["tokens"] else f"none fits (not even {ls['unit']} tokens)"
    if ls["capped"]:
        found += f": the model's own context (max_seq_len {ls['model_max_seq_len']:,}); it is not the limit"
    refused = f", {ls['refused']:,} do not" if ls["refused"] else ""
    budget = "" if ls["exact"] or ls["capped"] else "; stopped by the time budget"
    return (f"{what}{found}{refused} (batch {ls['batch_size']}, multiples of {ls['unit']}; {ls['compiles']} "
            f"compiles, {ls['compile_seconds']:.0f} s{budget})")
