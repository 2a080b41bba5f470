"""Test-only SGLang custom weight loader: write every parameter the server holds to a file.

SGLang 0.5.23's `/get_weights_by_name` answers 400 for Qwen2 models, and `/weights_checker` gives
only checksums of dequantized values, so the real-server tests read parameters back through the
same extension point qurl's restore uses: `POST /update_weights_from_tensor {"load_format":
"qurl_sglang_dump.dump_params"}` on a server launched with `--custom-weight-loader
qurl_sglang_dump.dump_params` and this directory on PYTHONPATH. Each call saves
{SGLang parameter name: tensor} (raw bytes and dtype, in the layout the server holds them) to
`$QURL_SGLANG_DUMP_DIR/tp<rank>_<pid>_<n>.pt`, n counting calls in this process.
`dump_ptrs` (flag `qurl_sglang_dump.dump_ptrs`) saves each parameter's `data_ptr` instead: called
before qurl's restore in a session, it shows where the post-processed weights the server computes
with live, so a test can check that updates keep them in place.
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


def dump_ptrs(model: torch.nn.Module, named_tensors: list) -> None:
    """Save {SGLang parameter name: data_ptr} (where each parameter's bytes live on the device:
    what a captured CUDA graph reads) to `$QURL_SGLANG_DUMP_DIR/ptrs_tp<rank>_<pid>_<n>.pt`."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    ptrs = {name: int(p.data_ptr()) for name, p in model.named_parameters()}
    out = os.path.join(os.environ["QURL_SGLANG_DUMP_DIR"],
                       f"ptrs_tp{rank}_{os.getpid()}_{next(_calls)}.pt")
    torch.save(ptrs, out + ".tmp")
    os.replace(out + ".tmp", out)


def corrupt_one_code(model: torch.nn.Module, named_tensors: list) -> None:
    for name, p in model.named_parameters():
        if name.endswith("qkv_proj.weight") and p.dtype in (torch.int8, torch.float8_e4m3fn):
            bits = p.data.view(torch.uint8)  # same itemsize: a view of the same storage
            bits[0, 0] = bits[0, 0] ^ 1
            with open(os.path.join(os.environ["QURL_SGLANG_DUMP_DIR"], "corrupted.txt"), "w") as f:
                f.write(name)
            return


def corrupt_kv_code_last_rank(model: torch.nn.Module, named_tensors: list) -> None:
    """On the last TP rank only: flip one bit of the first code of the k part of the first
    qkv_proj (row output_partition_sizes[0] in the loading layout [out, in]: call it after
    qurl's restore on W8A8 servers). With fewer kv heads than ranks that head is replicated:
    the other ranks' copies stay right. Writes the HF name to corrupted.txt."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if rank != world - 1:
        return
    for name, module in model.named_modules():
        p = getattr(module, "weight", None)
        if name.endswith("qkv_proj") and p is not None and p.dtype in (torch.int8,
                                                                       torch.float8_e4m3fn):
            row = module.output_partition_sizes[0]
            bits = p.data.view(torch.uint8)
            bits[row, 0] = bits[row, 0] ^ 1
            with open(os.path.join(os.environ["QURL_SGLANG_DUMP_DIR"], "corrupted.txt"), "w") as f:
                f.write(name.replace("qkv_proj", "k_proj") + ".weight")
            return


def corrupt_next_verified_repack(model: torch.nn.Module, named_tensors: list) -> None:
    """A repack that is not layout-only, once: the first `process_weights_after_loading` of the
    first 8-bit qkv_proj that runs after the server verified a NEW version (the closing repack
    of qurl's verification session, i.e. after its in-session check) runs SGLang's own, then
    flips one bit of the repacked weight the kernel reads (its first byte). Writes the HF name
    (the q part) to corrupted.txt when it fires."""
    from qurl.engines.sglang.inside import apply

    seen = apply.STATE.verified
    for name, module in model.named_modules():
        p = getattr(module, "weight", None)
        if not (name.endswith("qkv_proj") and p is not None
                and p.dtype in (torch.int8, torch.float8_e4m3fn)):
            continue
        method = module.quant_method
        original = method.process_weights_after_loading

        def repack(layer: torch.nn.Module, _module=module, _name=name) -> None:
            original(layer)
            now = apply.STATE.verified
            if layer is not _module or now is None or now == seen:
                return
            bits = layer.weight.data.view(torch.uint8)  # [in, out]: a view of the same storage
            bits[0, 0] = bits[0, 0] ^ 1
            del method.process_weights_after_loading  # once
            with open(os.path.join(os.environ["QURL_SGLANG_DUMP_DIR"], "corrupted.txt"), "w") as f:
                f.write(_name.replace("qkv_proj", "q_proj") + ".weight")
        method.process_weights_after_loading = repack
        return
