"""Pure-torch `rotary_embedding`, the op SGLang 0.5.23's generic platform imports from vLLM.

`layers/rotary_embedding/base.py` calls `vllm._custom_ops.rotary_embedding(positions, query, key,
head_size, cos_sin_cache, is_neox)` when neither CUDA nor SGLang's CPU kernels are present. It
rotates `query` and `key` in place. Shapes: positions [T]; query [T, Hq*D] (or [T, Hq, D]); key
[T, Hk*D]; cos_sin_cache [max_pos, rot_dim] holding cos | sin halves. Only the first rot_dim of
each head is rotated. NeoX layout rotates the two halves; GPT-J layout rotates interleaved pairs.
Only the CPU tests' SGLang venv puts this directory on PYTHONPATH.
"""
import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int,
            is_neox: bool) -> None:
    shape = x.shape
    x = x.view(shape[0], -1, head_size)
    rot = cos.shape[-1] * 2
    part = x[..., :rot]
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if is_neox:
        x1, x2 = part[..., : rot // 2].clone(), part[..., rot // 2:].clone()
        part[..., : rot // 2] = x1 * c - x2 * s
        part[..., rot // 2:] = x2 * c + x1 * s
    else:
        x1, x2 = part[..., 0::2].clone(), part[..., 1::2].clone()
        part[..., 0::2] = x1 * c - x2 * s
        part[..., 1::2] = x2 * c + x1 * s


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    _rotate(query, cos, sin, head_size, is_neox)
    if key is not None:
        _rotate(key, cos, sin, head_size, is_neox)
