"""report.json, report.md and throughput.png for `python -m benchmarks.run`."""
from __future__ import annotations

import json
import os


def _ms(s):
    return f"{s * 1e3:.1f}"


def _contenders_table(contenders: dict) -> list[str]:
    lines = ["| contender | median ms/step | min | max | samples/s (median) | windows |", "|---|---|---|---|---|---|"]
    for name, c in contenders.items():
        lines.append(f"| {name} | {_ms(c['median_step_s'])} | {_ms(c['min_step_s'])} | {_ms(c['max_step_s'])} | "
                     f"{c.get('samples_per_s', 0):,.0f} | {c['windows']} |")
    return lines


def markdown(report: dict) -> str:
    m = report["machine"]
    out = [f"# jdp benchmarks ({report['mode']} run, {report['created']})", "",
           f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, jax {m['jax']} / jaxlib "
           f"{m['jaxlib']}, backend {m['backend']}, {m['devices']} × {m['device_kind']} devices, "
           f"torch {m['torch'] or 'not installed'}, PJRT_NPROC={m['pjrt_nproc']}"
           f"{', XLA_FLAGS=' + repr(m['xla_flags']) if m.get('xla_flags') else ''}. Total {report['seconds']:.0f} s.", "",
           "Each round times every contender once, in a shuffled order, with block_until_ready at the end of "
           "each window; a ratio is the median over rounds of the two contenders' times in that round, and "
           "q1–q3 is the interquartile range of those per-round ratios (the noise). Machine-dependent: compare "
           "ratios, not absolute times.", "",
           "## Ratios", "", "| ratio | value (median) | q1–q3 | target | met | what |", "|---|---|---|---|---|---|"]
    for r in report["ratios"]:
        target = "" if r["target"] is None else f"≥ {r['target']}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        iqr = "" if r.get("q1") is None else f"{r['q1']:.3f}–{r['q3']:.3f}"
        out.append(f"| {r['ratio']} | {r['value']:.3f} | {iqr} | {target} | {met} | {r['what']} |")
    if "gpu" in report:
        g = report["gpu"]
        out += ["", "## GPU: bf16 GPT (UNTESTED path)", "", "| key | value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in g.items()]
    h = report.get("handwritten")
    if h:
        out += ["", f"## 1. jdp vs hand-written jit(shard_map) and jax.pmap steps with pmean (MLP {'-'.join(map(str, h['mlp']))}, "
                f"{h['params']:,} params, Adam fp32, global batch {h['global_batch']}, {h['devices']} devices)", ""]
        out += _contenders_table(h["contenders"])
        out += ["", "First call (compile + 1 step), s: " + ", ".join(f"{k} {v:.2f}" for k, v in h["first_call_s"].items()),
                "Max |Δparam| vs hand-written after 4 steps: " + ", ".join(
                    f"{k} {v:.1e}" for k, v in h["max_param_diff_vs_handwritten_after_4_steps"].items()),
                "Pre-placed batches: " + ", ".join(f"{k} = {v}" for k, v in h["placed_batch"].items())]
    d = report.get("ddp")
    if d:
        out += ["", "## 2. jdp vs PyTorch DDP", ""]
        if "skipped" in d:
            out.append(f"Skipped: {d['skipped']}.")
        else:
            out += [f"torch {d['torch']}, {d['ddp']}; MLP {'-'.join(map(str, d['mlp']))}.", ""]
            out += _contenders_table(d["contenders"])
    t = report.get("train_loop")
    if t:
        out += ["", f"## 3. Host loop: jdp.train.train vs the compiled step alone ({t['task']}, hidden "
                f"{t['mlp_hidden']}, global batch {t['global_batch']}, {t['devices']} devices)", "",
                "| loop | samples/s (median) | rounds |", "|---|---|---|",
                f"| jdp.train.train (first log interval excluded) | {t['train_loop_samples_per_s']:,.0f} | "
                + ", ".join(f"{x:,.0f}" for x in t["train_loop_rounds"]) + " |",
                f"| step alone, pre-staged batches | {t['step_alone_samples_per_s']:,.0f} | "
                + ", ".join(f"{x:,.0f}" for x in t["step_alone_rounds"]) + " |", "",
                "train() wall time per round incl. compile, eval, checkpoint: "
                + ", ".join(f"{x:.1f} s" for x in t["train_wall_s_incl_compile_eval_checkpoint"])]
    a = report.get("accum")
    if a:
        out += ["", f"## 4. Accumulation (M = {a['accum_steps']}, MLP {'-'.join(map(str, a['mlp']))}, global batch "
                f"{a['global_batch']})", "",
                "| accum_sync | median ms / optimizer step | gradient all-reduces / update | all-reduce bytes / update "
                "| ring bytes / device | gradient bytes |", "|---|---|---|---|---|---|"]
        for sync, x in a["modes"].items():
            out.append(f"| {sync} | {_ms(x['median_step_s'])} | {x['gradient_allreduces_per_update']} | "
                       f"{x['allreduce_bytes_per_update']:,} | {x['ring_bytes_per_device']:,.0f} | {x['gradient_bytes']:,} |")
    s = report.get("scaling")
    if s:
        out += ["", "## 5. Scaling over fake CPU devices (global batch 256, jdp shard_map, Adam fp32)", "",
                f"Note: {s['note']}. Memory is per device, from the state's pytrees (params, Adam m and v + count); "
                f"gradients have the params' shapes and dtype, so they are counted as equal to the params. In fp32 "
                f"that is 4 + 4 + 4 + 4 = {s['bytes_per_param_fp32_adam']} bytes/param, the same total as the usual "
                f"estimate for AdamW in mixed precision (fp32 master 4 + m 4 + v 4 + bf16 weights 2 + bf16 grads 2 = "
                f"{s['bytes_per_param_adamw_mixed_precision']}), made of different parts. Data parallelism "
                f"replicates all of it: per-device memory does not shrink with more devices.", "",
                "| MLP | params | devices | median ms/step | samples/s | first call s (compile + 1 step) | "
                "params B/dev | grads B/dev | Adam state B/dev | total B/dev | bytes/param |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(s["rows"], key=lambda r: (r["params"], r["devices"])):
            out.append(f"| {'-'.join(map(str, r['sizes']))} | {r['params']:,} | {r['devices']} | {_ms(r['median_step_s'])} | "
                       f"{r['samples_per_s']:,.0f} | {r['first_call_s']:.2f} | {r['params_bytes_per_device']:,} | "
                       f"{r['grads_bytes_per_device']:,} | {r['opt_state_bytes_per_device']:,} | "
                       f"{r['total_bytes_per_device']:,} | {r['bytes_per_param']:.2f} |")
        if s["errors"]:
            out.append("")
            out += [f"- {n} devices failed: {e}" for n, e in s["errors"].items()]
    out += _zero_section(report.get("zero"))
    out += _fsdp_section(report.get("fsdp"))
    out += _data_section(report.get("data"))
    return "\n".join(out) + "\n"


def _data_section(d: dict | None) -> list[str]:
    if not d:
        return []
    out = ["", f"## 7. Input pipeline: loader batches/s vs the char GPT step (global batch {d['global_batch']}, "
           f"{d['batches_timed']} batches timed, {d['cpu_count']} CPUs)", "",
           "| loader | batches/s | × the step |", "|---|---|---|"]
    step = d["char_gpt_steps_per_s_2_devices"]
    for name, rate in d["loader_batches_per_s"].items():
        out.append(f"| {name} | {rate:,.1f} | {rate / step:.1f} |")
    out += [f"| char GPT step, 2 fake CPU devices (steps/s) | {step:,.1f} | 1 |", "",
            f"Speed-up on the transform-heavy source: 2 threads {d['speedup_2_threads']:.2f}×, 2 worker processes "
            f"{d['speedup_2_workers']:.2f}×.", "",
            "| token file | RssAnon after opening | after the batches | VmRSS after (incl. page cache) | windows | "
            "a permutation of them would take |", "|---|---|---|---|---|---|"]
    for name, m in d["memory"].items():
        out.append(f"| {name} | {m['after_open'] / 2**20:.1f} MiB | {m['after_batches'] / 2**20:.1f} MiB "
                   f"({m['batches']} batches) | {m['vmrss_after_batches'] / 2**20:.1f} MiB | {m['windows']:,} | "
                   f"{m['permutation_bytes_it_would_need'] / 2**20:.1f} MiB |")
    return out


def _zero_section(z: dict | None) -> list[str]:
    """Part 6: the optimizer state sharded (ZeRO-1) vs replicated: step time and bytes per device."""
    if not z:
        return []
    out = ["", f"## 6. Optimizer state sharded (ZeRO-1) vs replicated (MLP {'-'.join(map(str, z['mlp']))}, "
           f"{z['params']:,} params, Adam, {z['devices']} devices, global batch {z['global_batch']})", "",
           "| layout | median ms/step | samples/s |", "|---|---|---|"]
    for name in ("replicated", "sharded"):
        out.append(f"| {name} | {_ms(z[name]['median_step_s'])} | {z[name]['samples_per_s']:,.0f} |")
    out += ["", f"Sharded / replicated step time: {z['ratio_sharded_over_replicated']:.3f} (paired rounds).", ""]
    memory = z.get("memory", {})
    if "rows" not in memory:
        return out + [f"Memory table failed: {memory.get('error', 'no result')}"]
    out += [f"Bytes per device ({memory['formula']}):", "",
            "| devices | layout | params B | gradient B | optimizer state B | bytes/param |", "|---|---|---|---|---|---|"]
    for r in memory["rows"]:
        out.append(f"| {r['devices']} | {r['layout']} | {r['params']:,} | {r['gradient']:,} | "
                   f"{r['optimizer_state']:,} | {r['bytes_per_param']:.2f} |")
    return out


def _fsdp_section(f: dict | None) -> list[str]:
    """Part 7: params, gradient and optimizer state sharded (FSDP) vs ZeRO-1 vs replicated."""
    if not f:
        return []
    from benchmarks.fsdp import markdown as fsdp_markdown

    out = ["", "## 7. Params sharded (FSDP) vs ZeRO-1 vs replicated", ""]
    memory = f.get("memory", {})
    if "rows" not in memory:
        return out + [f"Memory table failed: {memory.get('error', 'no result')}"]
    return out + fsdp_markdown(f, memory).splitlines()


def plot(report: dict, path: str) -> str | None:
    """throughput.png: samples/s against the device count per model, and the ratios against their targets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ratios = report.get("ratios", [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(4.2, 0.45 * len(ratios) + 1.2)),
                                   gridspec_kw={"width_ratios": [1, 1.25]})
    _scaling_panel(ax1, report.get("scaling", {}).get("rows", []))
    _ratios_panel(ax2, ratios)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _scaling_panel(ax, rows: list[dict]) -> None:
    from matplotlib.ticker import NullLocator

    for name in sorted({"-".join(map(str, r["sizes"])) for r in rows}, key=lambda n: [int(x) for x in n.split("-")]):
        pts = sorted((r["devices"], r["samples_per_s"]) for r in rows if "-".join(map(str, r["sizes"])) == name)
        ax.plot(*zip(*pts), marker="o", label=f"MLP {name}")
    # Device counts are powers of two: a base-2 log axis spaces them evenly, and without minor
    # ticks matplotlib labels no 3 or 6 (as "3×10^0") between them.
    ax.set(title="jdp throughput vs fake CPU devices (global batch 256)", xlabel="devices", ylabel="samples/s",
           yscale="log")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    if rows:
        devices = sorted({r["devices"] for r in rows})
        ax.set_xticks(devices, [str(d) for d in devices])
        ax.legend()


def _ratios_panel(ax, ratios: list[dict]) -> None:
    """One horizontal bar per ratio, its name on the y axis (long names fit there, unlike under
    vertical bars), its value at the bar's end and its target as a black tick across the bar."""
    colors = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    ys = list(range(len(ratios)))[::-1]  # the first ratio on top, as in report.md
    ax.barh(ys, [r["value"] for r in ratios], color=[colors[r["met"]] for r in ratios], height=0.6)
    for y, r in zip(ys, ratios):
        if r["target"] is not None:
            ax.vlines(r["target"], y - 0.4, y + 0.4, colors="black", linewidth=2)
        ax.text(max(r["value"], r["target"] or 0) + 0.04, y, f"{r['value']:.2f}", va="center", fontsize=9)
    ax.set_yticks(ys, [r["ratio"].replace("_over_", " / ") for r in ratios], fontsize=9)
    ax.set_xlim(0, 1.15 * max([r["value"] for r in ratios] + [r["target"] or 0 for r in ratios] + [1]))
    ax.set(title="ratios (green: target met, red: not met, grey: no target; black tick: target)",
           xlabel="ratio (each one's meaning: report.md)")
    ax.title.set_fontsize(10)


def write_report(report: dict, out: str) -> list[str]:
    paths = [os.path.join(out, "report.json"), os.path.join(out, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(paths[1], "w") as f:
        f.write(markdown(report))
    png = plot(report, os.path.join(out, "throughput.png"))
    return paths + ([png] if png else [])


if __name__ == "__main__":  # redraw throughput.png from a saved report.json, without running anything
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(out, "report.json")) as f:
        print(plot(json.load(f), os.path.join(out, "throughput.png")) or "needs matplotlib")
