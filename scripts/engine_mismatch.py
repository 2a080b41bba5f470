"""Offline rollout-precision mismatch of a checkpoint: KL(π_engine‖π_full) and ρ = π_full/π_engine.

Each quantized LocalEngine samples 64 answers (16 held-out synthetic questions × 4, temperature 1);
the fp32 model (the "bf16" precision of the local engine, which computes in fp32) scores the same
tokens teacher-forced. Prints, per precision, the mean k3 estimate of KL(engine‖full) per token,
the largest ρ and the share of tokens with ρ > 1.2 and ρ < 0.8 (where PPO's ε = 0.2 clipping of a
naive ratio acts).

    PYTHONPATH=. python scripts/engine_mismatch.py runs/search/_base/tiny-<key> int8 fp8 w4a16
"""
import sys

import torch

from qurl.data.synthetic import arithmetic_task
from qurl.data.templates import render_prompt
from qurl.engines.local import LocalEngine
from qurl.types import GenRequest, SamplingParams


def main(model_dir: str, precisions: list[str]) -> None:
    torch.set_num_threads(1)
    full = LocalEngine(model_dir, precision="bf16")
    tok = full.tokenizer
    examples = arithmetic_task(16, seed=0, split="eval", digits=1, n_operands=3)
    reqs = [GenRequest(rid=str(i), prompt_ids=tok.encode(render_prompt(e.prompt, "plain",
                                                                       tokenizer=tok)),
                       params=SamplingParams(temperature=1.0, max_new_tokens=32, seed=i))
            for i, e in enumerate(examples * 4)]
    for precision in precisions:
        res = LocalEngine(model_dir, precision=precision, seed=1).generate(reqs)
        log_rho = torch.cat([full.logprobs(r.prompt_ids, r.output_ids.tolist()) - r.logprobs
                             for r in res])
        rho = log_rho.exp()
        k3 = rho - 1 - log_rho
        print(f"{precision}: KL {k3.mean():.2e}  max rho {rho.max():.2f}  "
              f"rho>1.2 {(rho > 1.2).float().mean():.4f}  rho<0.8 {(rho < 0.8).float().mean():.4f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
