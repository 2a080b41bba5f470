"""Test-only SGLang custom weight loader: write every parameter the server holds to a file.

SGLang 0.5.23's `/get_weights_by_name` answers 400 for Qwen2 models, and `/weights_checker` gives
only checksums of dequantized values, so the real-server tests read parameters back through the
same extension point qurl's restore uses: `POST /update_weights_from_tensor {"load_format":
"qurl_sglang_dump.dump_params"}` on a server launched with `--custom-weight-loader
qurl_sglang_dump.dump_params` and this directory on PYTHONPATH. Each call saves
{SGLang parameter name: tensor} (raw bytes and dtype, in the layout the server holds them) to
`$QURL_SGLANG_DUMP_DIR/tp<rank>_<pid>_<n>.pt`, n counting calls in this process.
"""
import itertools
import os

import torch

_calls = itertools.count()


def dump_params(model: torch.nn.Module, named_tensors: list) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    name = f"tp{rank}_{os.getpid()}_{next(_calls)}.pt"
    out = os.path.join(os.environ["QURL_SGLANG_DUMP_DIR"], name)
    torch.save(state, out + ".tmp")
    os.replace(out + ".tmp", out)
