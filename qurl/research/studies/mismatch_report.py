"""The real-model page's measured blocks: mismatch tables and plot, UAQ flips, sync bytes.

    python -m qurl.research.studies.mismatch_report --data DIR [--uaq uaq.json] [--page docs/real_model.md]

Reads what qurl.research.studies.mismatch_collect wrote into DIR (gen_<precision>.pt, prox_<precision>_<dtype>.pt;
arms missing a file are skipped and listed), the JSON of qurl.research.studies.uaq_probe, and measures the
sync bytes (qurl.research.studies.sync_bytes). Writes docs/real_model_mismatch.json (every number of the
tables), docs/real_model_mismatch.png, and replaces, in the page, only the text between
`<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->` (NAME: mismatch, uaq, sync_bytes),
so the hand-written text around them and other sections stay; a page without the markers gets the
missing sections appended under their headings.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

from qurl.research.studies.mismatch import POSITION_EDGES, PROB_EDGES, analyse
from qurl.research.studies.mismatch_collect import DTYPES, PRECISIONS

HEADINGS = {"mismatch": "## 8-bit mismatch", "uaq": "## UAQ on this model",
            "sync_bytes": "## Sync bytes by tensor kind"}


def collect(data: Path) -> tuple[list[dict], list[str]]:
    """One record per (precision, learner dtype) with both files: its analysis and batch facts."""
    arms, missing = [], []
    for prec in PRECISIONS:
        g = data / f"gen_{prec}.pt"
        if not g.is_file():
            missing.append(f"gen {prec}")
            continue
        gen = torch.load(g)
        for dt in DTYPES:
            f = data / f"prox_{prec}_{dt}.pt"
            if not f.is_file():
                missing.append(f"{prec} vs learner {dt}")
                continue
            prox = torch.load(f)["prox_logp"]
            res = analyse(prox, gen["behav_logp"], gen["loss_mask"], gen["adv"], gen["prompt_len"])
            res.update(precision=prec, learner=dt, responses=int(gen["tokens"].shape[0]),
                       reward_mean=float(gen["rewards"].mean()),
                       adv_nonzero=float((gen["adv"] != 0).float().mean()),
                       new_tokens=int(gen["new_tokens"]),
                       cut_frac=float((gen["loss_mask"].sum(1) >= gen["new_tokens"]).float().mean()))
            arms.append(res)
    return arms, missing


def _g(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.2f}%"


def exact_header(arms: list[dict]) -> list[str]:
    """The headline table of mismatch_exact's arms (exact per-position values and sampled tokens)."""
    lines = ["| rollout | learner | contexts / positions | KL exact, mean | KL exact, p99 of positions | "
             "KL sampled (k3) | k3 p99 | max ρ (sampled) | ρ > 2 exact | ρ > 2 sampled | ρ < 1/2 sampled |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in arms:
        s = a["summary"]
        lines.append(f"| {a['precision']} | {a['learner']} | {a['responses']} / {a['positions']} | "
                     f"{_g(a['kl_exact'])} | {_g(a['kl_exact_p99'])} | {_g(s['kl_mean'])} | "
                     f"{_g(s['kl_p99'])} | {_g(s['rho_max'], 3)} | {_pct(a['trunc_exact'])} | "
                     f"{_pct(s['trunc_frac'])} | {_pct(s['rho_low_frac'])} |")
    return lines


def _pct_sig(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.2g}%"


def mismatch_block(arms: list[dict], missing: list[str], plot: str, exact: bool = False) -> str:
    if exact:
        return _buckets(exact_header(arms), arms, plot)
    lines = ["| rollout | learner | responses | tokens | KL mean | KL p99 | max ρ | ρ > 2 (TIS cuts) | "
             "ACR widens | ρ < 1/2 | mean reward |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in arms:
        s = a["summary"]
        lines.append(f"| {a['precision']} | {a['learner']} | {a['responses']} | {int(s['tokens'])} | "
                     f"{_g(s['kl_mean'])} | {_g(s['kl_p99'])} | {_g(s['rho_max'], 3)} | "
                     f"{_pct(s['trunc_frac'])} | {_pct(s['acr_widened_frac'])} | "
                     f"{_pct(s['rho_low_frac'])} | {a['reward_mean']:.3f} |")
    if missing:
        lines += ["", f"Not measured (no data in this run): {', '.join(missing)}."]
    return _buckets(lines, arms, plot)


def _buckets(lines: list[str], arms: list[dict], plot: str) -> str:
    """lines + the by-position and by-probability tables of `arms` + the plot link."""
    for key, title, edges in (("by_position", "response position", POSITION_EDGES),
                              ("by_prob", "π_prox of the sampled token", PROB_EDGES)):
        heads = [f"[{_g(lo, 3)}, {_g(hi, 3)}" + ("]" if i == len(edges) - 2 else ")")
                 for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]
        lines += ["", f"KL mean per token, and (in parentheses) the bucket's share of the tokens / of "
                  f"the summed KL, by {title}:", "",
                  "| rollout | learner | " + " | ".join(heads) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in heads) + " |"]
        for a in arms:
            cells = [f"{_g(r['kl_mean'])} ({100 * r['token_share']:.0f}% / {100 * r['kl_share']:.0f}%)"
                     if r["tokens"] else "–" for r in a[key]]
            lines.append(f"| {a['precision']} | {a['learner']} | " + " | ".join(cells) + " |")
    lines += ["", f"![mismatch by position and probability]({plot})"]
    return "\n".join(lines)


def plot_arms(arms: list[dict], out: Path) -> Path:
    """Two panels: KL mean by response position, KL share by π_prox probability; a line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    for a in arms:
        style = "-" if a["learner"] == "bfloat16" else "--"
        label = f"{a['precision']} rollout / {a['learner']} learner"
        pos = [r for r in a["by_position"] if r["tokens"]]
        axes[0].plot([(r["lo"] + r["hi"]) / 2 for r in pos], [r["kl_mean"] for r in pos], style,
                     marker="o", label=label)
        prob = a["by_prob"]
        axes[1].plot(range(len(prob)), [r["kl_share"] for r in prob], style, marker="o", label=label)
    axes[0].set(xscale="log", yscale="log", xlabel="response position (bucket centre)",
                ylabel="KL(behav‖prox) per token", title="mismatch by position")
    axes[1].set_xticks(range(len(PROB_EDGES) - 1),
                       [f"[{lo:g},{hi:g})" for lo, hi in zip(PROB_EDGES[:-1], PROB_EDGES[1:])])
    axes[1].set(xlabel="π_prox of the sampled token", ylabel="share of the summed KL",
                title="where the KL sits, by token probability")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct (weights: de-quantized Q4_1 GGUF), T = 1.0, qurl local engine "
                 "vs Megatron learner", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def read_uaq(path: Path) -> dict:
    """uaq_probe's JSON lines -> {"flips": [...], "invariance": [...]} (a later row for the same
    (s, lr, step) or s replaces an earlier one)."""
    flips: dict[tuple, dict] = {}
    inv: dict[float, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("kind") == "invariance":
                inv[r["s"]] = r
            else:
                flips[(r["s"], r["lr"], r["step"])] = r
    return {"flips": [flips[k] for k in sorted(flips)], "invariance": list(inv.values())}


def uaq_block(res: dict) -> str:
    rows = sorted({r["rows"] for r in res["flips"]})
    lines = [f"Learner fp32, {', '.join(map(str, rows))} responses per step; flip fraction = share "
             "of 8-bit codes changed since the previous sync.", "",
             "| s | lr | sync after step | INT8 all | INT8 q/k/v/gate/up | INT8 o/down | FP8 all | "
             "FP8 q/k/v/gate/up | FP8 o/down | grad norm |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["flips"]:
        cells = [_pct_sig(r.get(f"{f}/flip_frac{k}", float("nan")))
                 for f in ("int8", "fp8") for k in ("", "/uaq_scaled", "/unscaled")]
        lines.append(f"| {r['s']:g} | {r['lr']:g} | {r['step']} | " + " | ".join(cells) +
                     f" | {_g(r['grad_norm'], 3)} |")
    lines += ["", "Logits of the fp32 HF model with UAQ at s against the unscaled model, full vocabulary:", "",
              "| s | positions × vocab | max \\|Δlogit\\| vs s = 1 | mean \\|Δlogit\\| | max \\|logit\\| |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for r in res["invariance"]:
        lines.append(f"| {r['s']:g} | {r['positions']} × 49152 | {r['max_abs_dlogit']:.3g} | "
                     f"{r['mean_abs_dlogit']:.3g} | {r['max_abs_logit']:.3g} |")
    return "\n".join(lines)


def sync_block(model: str) -> tuple[str, dict]:
    from qurl.models.registry import resolve_base
    from qurl.research.studies.sync_bytes import measure, table

    out, raw = [], {}
    for label, wire in (("local engine (computes in fp32: pass-throughs in fp32)", None),
                        ("SGLang server, --dtype bf16 (auto for this bf16 checkpoint)", torch.bfloat16)):
        rows = measure(resolve_base(model), "int8", wire)
        raw[label] = {k: {"bytes": v["bytes"], "elements": v["elements"]} for k, v in rows.items()}
        out += [f"INT8 sync to the {label}:", "", table(rows, "kind"), ""]
    return "\n".join(out).rstrip(), raw


def replace_block(page: str, name: str, body: str) -> str:
    """`page` with the generated block `name` set to `body` (appended under its heading if absent)."""
    begin, end = f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->"
    block = f"{begin}\n{body}\n{end}"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(page):
        return pat.sub(lambda _: block, page)
    return page.rstrip() + f"\n\n{HEADINGS[name]}\n\n{block}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.mismatch_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="directory of mismatch_collect's files")
    p.add_argument("--exact", type=Path, help="mismatch_exact's arms JSON (instead of --data)")
    p.add_argument("--uaq", type=Path, help="uaq_probe's JSON lines")
    p.add_argument("--sync-bytes", action="store_true", help="measure and write the sync-bytes block")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--page", type=Path, default=Path("docs/real_model.md"))
    a = p.parse_args(argv)
    page = a.page.read_text() if a.page.is_file() else "# SmolLM2-135M-Instruct in qurl\n"
    summary_path = a.page.with_name(a.page.stem + "_mismatch.json")
    raw = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if a.data is not None:
        if not a.data.is_dir():
            print(f"{a.data}: no such directory", file=sys.stderr)
            return 2
        arms, missing = collect(a.data)
        png = plot_arms(arms, a.page.with_name(a.page.stem + "_mismatch.png"))
        page = replace_block(page, "mismatch", mismatch_block(arms, missing, png.name))
        raw["mismatch"] = {"arms": arms, "missing": missing}
    if a.exact is not None:
        res = json.loads(a.exact.read_text())
        arms = res["arms"]
        png = plot_arms(arms, a.page.with_name(a.page.stem + "_mismatch.png"))
        page = replace_block(page, "mismatch", mismatch_block(arms, [], png.name, exact=True))
        raw["mismatch_exact"] = res
    if a.uaq is not None:
        res = read_uaq(a.uaq)
        page = replace_block(page, "uaq", uaq_block(res))
        raw["uaq"] = res
    if a.sync_bytes:
        body, raw["sync_bytes"] = sync_block(a.model)
        page = replace_block(page, "sync_bytes", body)
    a.page.parent.mkdir(parents=True, exist_ok=True)
    a.page.write_text(page)
    summary_path.write_text(json.dumps(raw, indent=1))
    print(a.page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
