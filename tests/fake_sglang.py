"""A stand-in for `python -m sglang.launch_server`, for CPU contract tests (SGLang cannot run here).

It is a real HTTP server (stdlib ThreadingHTTPServer) that speaks the request/response schema of
SGLang 0.5.23 for the endpoints qurl uses, read from that release's source:
`srt/entrypoints/http_server.py` (routes, status codes, `{"success", "message"}` bodies) and
`srt/managers/io_struct.py` (GenerateReqInput, UpdateWeightsFromDistributedReqInput,
InitWeightsUpdateGroupReqInput, PauseGenerationReqInput, ...). Request bodies are validated
(unknown or mistyped fields -> 400, as SGLang's pydantic layer would refuse).

What is real: the weight-update group. `/init_weights_update_group` joins exactly as SGLang's
`init_custom_process_group` does (tcp:// rendezvous -> PrefixStore(group_name) -> torch's
`_new_process_group_helper`), and `/update_weights_from_distributed` receives the broadcast exactly
as `receive_weights_from_distributed` does (flattened_bucket: one uint8 buffer, offsets recomputed,
alignment enforced; otherwise one broadcast per tensor). Weight updates are refused outside a
begin/end_weight_update session, as in 0.5.23.

What is fake: generation. Token t+1 = (31 * sum(ids) + len(ids) + 7 * version) % vocab over the
full context `ids` (prompt + generated so far), with log-prob -1 / (version + 2); one token every
`--token-delay` seconds, so a pause can interrupt a request mid-way. Finish reasons, per-token
`output_token_logprobs` as [logprob, token_id, text] and `weight_versions` spans follow SGLang.
With `top_logprobs_num` k > 0, `output_top_logprobs` holds per token k entries [logprob, id, None],
most likely first (SGLang's shape, `tokenizer_manager.py` `detokenize_top_logprobs_tokens`): the
sampled token, then ids tok+1, tok+2, ... with probabilities (1 - p0) / 2^j, p0 = exp(logprob).

Behaviours checked against the real server (tests/test_sglang_real.py, `make test-sglang`) and
imitated here: `/health` is a generation, so it waits while paused and answers 503 after
`--health-pause-timeout` (20 s in SGLang); `/model_info` answers while paused; W8A8 servers
(`w8a8_int8`, `w8a8_fp8`) refuse updates of linear weights with SGLang's `'Parameter' object has no
attribute 'weight_loader'` message unless qurl's restore loader ran in the session
(`/update_weights_from_tensor` with a load_format named in `--custom-weight-loader`), and an
`/end_weight_update` without it transposes the linears again; generation stops on the config's
`eos_token_id` unless `ignore_eos`; aborted requests finish with `{"type": "abort", "message":
"Aborted", "status_code": null, "err_type": null}`; `/flush_cache` answers 400 while requests run.

Still different from the real server (the real tests cover these instead): generation is the
closed form below, so `sampling_seed` and temperature change nothing (real 0.5.23 servers ignore
the seed unless started with --enable-deterministic-inference, which needs a GPU attention
backend); one TP rank only (a real TP = 2 server is tested in
tests/test_sglang_real_deploy.py); no vocabulary padding of embed_tokens (real: to a multiple of
128 rows); received weights are stored as sent (the real server fuses q/k/v and gate/up and keeps
W8A8 weights transposed); `/weights_checker` and `/get_weights_by_name` are not served;
`/update_weights_from_tensor` takes no tensors (only qurl's no-data restore).

Routes of a mixture of experts (config.json with `num_experts`, `num_experts_per_tok`,
`num_hidden_layers`), as SGLang 0.5.23 returns them: with `--enable-return-routed-experts` and a
body's `return_routed_experts`, `meta_info.routed_experts` is base64 of int32 [rows, L, k]
(`srt/managers/detokenizer_manager.py:432-447`, `tokenizer_manager.py:2602-2609`) for positions
[routed_experts_start_len, seqlen - 1), seqlen = input + output ids (`srt/state_capturer/base.py:
173-188`; a start beyond the input aborts the request, `srt/managers/scheduler.py:3300-3318`).
Position i's experts are those of the weights that forwarded it: the prompt's at the first step,
output token t's at the step after it; in layer l they are (7 * token_i + 3 * l + version + j) % E,
j = 0 .. k-1 (fake). An aborted running request still gets the routes of what it forwarded
(`scheduler.py:5797-5812`: one more decode step, then the normal finish path,
`scheduler_components/batch_result_processor.py:136-160`); one aborted before its first step and
every request on a server without the flag get none (`srt/state_capturer/routed_experts.py:50`),
without an error.

Test-only extras (never used by qurl): `--dump-dir` writes the received weights after every
`/end_weight_update` as safetensors; `/_fake/fault` injects malformed or stuck responses, or
(`refuse_update`) makes `/update_weights_from_distributed` refuse every bucket as real SGLang
refuses one outside a session: 400 at once, without joining the broadcast, or (`wedge`) makes it
a server whose scheduler is stuck, as a real one is when its scheduler process is SIGSTOPped
(tests/test_sglang_real_stall.py does that to one): /generate calls, running and new, make no
progress, /health and /health_generate answer 503 after `--health-pause-timeout` (SGLang's
SGLANG_HEALTH_CHECK_TIMEOUT), /model_info and /server_info still answer;
`/_fake/requests` lists the /generate bodies received; `/_fake/state` the session flags;
`/_fake/peak` the most requests that generated at once; `--die-once-at-bucket-2 FILE` makes the
process exit in the middle of its first sync (when FILE does not exist yet; it creates it).
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn,
          "int32": torch.int32, "int64": torch.int64}
SAMPLING_KEYS = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float),
                 "top_k": int, "sampling_seed": int, "stop_token_ids": list, "ignore_eos": bool,
                 "no_stop_trim": bool, "skip_special_tokens": bool}
GENERATE_KEYS = {"rid": str, "input_ids": list, "sampling_params": dict, "return_logprob": bool,
                 "logprob_start_len": int, "top_logprobs_num": int, "stream": bool,
                 "return_text_in_logprobs": bool, "text": str, "return_routed_experts": bool,
                 "routed_experts_start_len": int}


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    return any(f".{k}.weight" in name for k in LINEARS)


class BadRequest(Exception):
    pass


def check_body(body: dict, spec: dict, required: tuple[str, ...] = ()) -> None:
    for k in body:
        if k not in spec:
            raise BadRequest(f"unknown field {k!r}")
        if body[k] is not None and not isinstance(body[k], spec[k]):
            raise BadRequest(f"field {k!r}: wrong type {type(body[k]).__name__}")
    for k in required:
        if body.get(k) is None:
            raise BadRequest(f"field {k!r} required")


class FakeSGLang:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = args.weight_version
        self.vocab = 100
        cfg = Path(args.model_path) / "config.json"
        if cfg.is_file():
            self.vocab = int(json.loads(cfg.read_text()).get("vocab_size", 100))
        self.cond = threading.Condition()
        self.paused = False
        self.pause_mode = "abort"
        self.running: dict[str, dict] = {}  # rid -> {"abort": bool}
        self.peak_running = 0  # the most requests generating at once (SGLang would cap it at
        # max_running_requests and queue the rest; the fake runs them all, so tests can count)
        self.session = False
        self.groups: dict[str, object] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.requests: list[dict] = []
        self.fault: str | None = None
        self.buckets_seen = 0
        self.ready_at = time.time() + args.startup_delay
        self.eos = None
        self.moe: tuple[int, int, int] | None = None  # (L, k, E) of a mixture of experts
        if cfg.is_file():
            c = json.loads(cfg.read_text())
            self.eos = c.get("eos_token_id")
            if c.get("num_experts"):
                self.moe = (c["num_hidden_layers"], c["num_experts_per_tok"], c["num_experts"])
        # W8A8 servers repack linears after loading (drop their weight loaders, transpose) and
        # 0.5.23's begin_weight_update does not undo it: only qurl's restore loader does
        self.repacks = args.quantization in ("w8a8_int8", "w8a8_fp8")
        self.restored = False
        self.transposed_twice = False  # an end_weight_update without a restore happened

    # ---------------------------------------------------------------- generation
    def generate(self, body: dict) -> tuple[int, object]:
        check_body(body, GENERATE_KEYS, ("input_ids",))
        if body.get("text") is not None or body.get("stream"):
            raise BadRequest("this fake serves token ids, non-streaming only")
        sp = body.get("sampling_params") or {}
        check_body(sp, SAMPLING_KEYS)
        ids = body["input_ids"]
        if not ids or not all(isinstance(i, int) and 0 <= i < self.vocab for i in ids):
            raise BadRequest("input_ids must be token ids in [0, vocab)")
        self.requests.append(body)
        rid = body.get("rid") or f"r{len(self.requests)}"
        if self.fault == "hang":
            time.sleep(3600)
        with self.cond:
            while self.paused:  # SGLang holds new requests while paused
                self.cond.wait()
            state = {"abort": False}
            self.running[rid] = state
            self.peak_running = max(self.peak_running, len(self.running))
        out, lps, spans = [], [], []
        fwd: list[int] = []  # version that forwarded each position (the routes' weights)
        start = int(body.get("routed_experts_start_len") or 0)
        if body.get("return_routed_experts") and not 0 <= start <= len(ids):
            rid = body.get("rid") or f"r{len(self.requests)}"
            return 200, {"text": "", "output_ids": [], "meta_info": {
                "id": rid, "finish_reason": {"type": "abort", "message":
                f"routed_experts_start_len={start} is outside [0, {len(ids)}]"},
                "prompt_tokens": len(ids), "weight_version": self.version,
                "completion_tokens": 0, "output_token_logprobs": []}}
        finish = {"type": "length", "length": sp.get("max_new_tokens", 128)}
        stops = set(sp.get("stop_token_ids") or [])
        try:
            for _ in range(sp.get("max_new_tokens", 128)):
                time.sleep(self.args.token_delay)
                with self.cond:
                    while self.fault == "wedge":  # a stuck scheduler: no token, no abort
                        self.cond.wait()
                    while self.paused and self.pause_mode == "in_place" and not state["abort"]:
                        self.cond.wait()
                    if state["abort"]:
                        finish = {"type": "abort", "message": "Aborted", "status_code": None,
                                  "err_type": None}
                        break
                    version = self.version
                fwd += [int(version)] * (len(ids) if not out else 1)  # prefill, or last token
                ctx = ids + out
                tok = (31 * sum(ctx) + len(ctx) + 7 * int(version)) % self.vocab
                out.append(tok)
                lps.append(-1.0 / (int(version) + 2))
                if spans and spans[-1]["version"] == version:
                    spans[-1]["end"] += 1
                else:
                    spans.append({"version": version, "start": len(out) - 1, "end": len(out)})
                if tok in stops or (tok == self.eos and not sp.get("ignore_eos")):
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            with self.cond:
                self.running.pop(rid, None)
                self.cond.notify_all()
        if self.fault == "short_logprobs":
            lps = lps[:-1]
        if self.fault == "nan_logprob" and lps:
            lps[0] = float("nan")
        k = int(body.get("top_logprobs_num") or 0)
        meta_top = {} if k <= 0 else {"output_top_logprobs": [
            [[lp, t, None]] + [[math.log((1 - math.exp(lp)) / 2 ** j), (t + j) % self.vocab, None]
                               for j in range(1, k)] for lp, t in zip(lps, out)]}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), **meta_top,
                "weight_version": self.version, "completion_tokens": len(out), "cached_tokens": 0,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
                "output_token_logprobs_length": len(lps), "input_token_logprobs": [],
                "weight_versions": spans or [{"version": self.version, "start": 0, "end": 0}]}
        if body.get("return_routed_experts") and self.args.enable_return_routed_experts \
                and self.moe is not None and fwd:
            meta["routed_experts"] = self.routes(ids + out, fwd, start)
        if self.fault == "no_meta":
            return 200, {"text": "", "output_ids": out}
        if self.fault == "bad_json":
            return 200, b"{not json"
        return 200, {"text": "", "output_ids": out, "meta_info": meta}

    def routes(self, seq: list[int], fwd: list[int], start: int) -> str:
        """base64 of int32 [len(fwd) - start, L, k]: position i's experts at version fwd[i]."""
        layers, k, experts = self.moe
        rows = [[[(7 * seq[i] + 3 * lay + v + j) % experts for j in range(k)]
                 for lay in range(layers)] for i, v in enumerate(fwd)][start:]
        if self.fault == "short_routes":  # one position fewer than asked
            rows = rows[:-1]
        flat = torch.tensor(rows, dtype=torch.int32).reshape(-1)
        return base64.b64encode(flat.numpy().astype("<i4").tobytes()).decode()

    def pause(self, body: dict) -> tuple[int, object]:
        check_body(body, {"mode": str, "rid": str})
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode {mode!r}")
        with self.cond:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                for st in self.running.values():
                    st["abort"] = True
                while self.running:
                    self.cond.wait()
            self.cond.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> tuple[int, object]:
        check_body(body, {"torch_empty_cache": bool, "rid": str})
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self) -> tuple[int, object]:
        with self.cond:
            busy = bool(self.running) and not self.paused
        if busy:
            return 400, b"Flush cache failed.\n"
        return 200, b"Cache flushed.\nPlease check backend logs for more details.\n"

    # ---------------------------------------------------------------- weights
    def init_group(self, body: dict) -> tuple[int, object]:
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import (Backend, _new_process_group_helper, _world,
                                                        rendezvous)

        check_body(body, {"master_address": str, "master_port": int, "rank_offset": int,
                          "world_size": int, "group_name": str, "backend": str, "rid": str},
                   ("master_address", "master_port", "rank_offset", "world_size"))
        name = body.get("group_name") or "weight_update_group"
        rank = body["rank_offset"] + 0  # + tp_rank; this fake has one TP rank
        try:
            timeout = timedelta(seconds=self.args.group_timeout)
            url = f"tcp://{body['master_address']}:{body['master_port']}"
            store, _, _ = next(rendezvous(url, rank, body["world_size"], timeout=timeout))
            store.set_timeout(timeout)
            store = PrefixStore(name, store)
            pg, _ = _new_process_group_helper(body["world_size"], rank, [],
                                              Backend(body.get("backend") or "nccl"), store,
                                              group_name=name, backend_options=None,
                                              timeout=timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(body["world_size"])}
            self.groups[name] = pg
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> tuple[int, object]:
        check_body(body, {"group_name": str, "rid": str})
        name = body.get("group_name") or "weight_update_group"
        pg = self.groups.pop(name, None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        import torch.distributed as dist

        try:  # as SGLang: the group's connections close, so a peer's pending broadcast fails
            dist.destroy_process_group(pg)
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to destroy custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin(self, body: dict) -> tuple[int, object]:
        check_body(body, {"selector": str, "rid": str})
        if self.session:
            return 400, {"success": False, "message": "a weight-update session is already open; "
                                                      "call end_weight_update() first"}
        self.session = True
        return 200, {"success": True, "message": "Success"}

    def end(self, body: dict) -> tuple[int, object]:
        check_body(body, {"rid": str})
        if not self.session:
            return 400, {"success": False, "message": "no weight-update session is open; call "
                                                      "begin_weight_update() first"}
        self.session = False
        if self.repacks and not self.restored:  # SGLang re-runs the repacking: transposes again
            self.transposed_twice = True
            for n, t in list(self.weights.items()):
                if _is_linear(n) and t.dim() == 2:
                    self.weights[n] = t.t().contiguous()
        self.restored = False
        if self.args.dump_dir:
            from safetensors.torch import save_file

            path = Path(self.args.dump_dir) / f"port{self.args.port}_v{self.version}.safetensors"
            save_file({k: v.contiguous() for k, v in self.weights.items()}, str(path))
        return 200, {"success": True, "message": "Success"}

    def update_distributed(self, body: dict) -> tuple[int, object]:
        import torch.distributed as dist

        check_body(body, {"names": list, "dtypes": list, "shapes": list, "group_name": str,
                          "flush_cache": bool, "abort_all_requests": bool, "weight_version": str,
                          "load_format": str, "selector": str, "torch_empty_cache": bool,
                          "rid": str}, ("names", "dtypes", "shapes"))
        if not self.session or self.fault == "refuse_update":
            return 400, {"success": False, "message": "update_weights_from_distributed must run "
                         "between begin_weight_update() and end_weight_update()"}
        self.buckets_seen += 1
        marker = self.args.die_once_at_bucket_2
        if marker and self.buckets_seen == 2 and not Path(marker).exists():
            Path(marker).write_text("died")  # a crash in the middle of a sync, once per marker
            os._exit(1)
        name = body.get("group_name") or "weight_update_group"
        if name not in self.groups:
            return 400, {"success": False, "message": f"Failed to receive weights: Group {name} "
                         f"not in {list(self.groups)}"}
        pg = self.groups[name]
        try:
            dts = [DTYPES[d] for d in body["dtypes"]]
            if body.get("load_format") == "flattened_bucket":
                offset, metas = 0, []
                for n, dt, shape in zip(body["names"], dts, body["shapes"], strict=True):
                    if offset % dt.itemsize:
                        raise ValueError(f"Unaligned received tensor {n}: byte offset {offset}")
                    size = torch.Size(shape).numel() * dt.itemsize
                    metas.append((n, dt, shape, offset, size))
                    offset += size
                if not metas:
                    raise ValueError("Cannot create empty tensor bucket")
                flat = torch.empty(offset, dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=pg)
                got = [(n, flat[o:o + s].view(dt).reshape(shape)) for n, dt, shape, o, s in metas]
            else:
                got, handles = [], []
                for n, dt, shape in zip(body["names"], dts, body["shapes"], strict=True):
                    t = torch.empty(shape, dtype=dt)
                    handles.append(dist.broadcast(t, src=0, group=pg, async_op=True))
                    got.append((n, t))
                for h in handles:
                    h.wait()
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to receive weights: {e}"}
        if self.repacks and not self.restored and any(_is_linear(n) for n, _ in got):
            return 400, {"success": False, "message": "Failed to update parameter online: "
                         "'Parameter' object has no attribute 'weight_loader'. The full weights "
                         "of the ModelRunner are partially updated. Please discard the whole "
                         "weights."}
        self.weights.update(got)
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        if body.get("flush_cache", True):
            code, _ = self.flush_cache()
            if code != 200:
                return 400, {"success": False, "message": "Weights were updated, but the cache "
                             "was not flushed because requests are still running or queued."}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def update_tensor(self, body: dict) -> tuple[int, object]:
        """Only the no-data custom loaders qurl uses: the restore (a list of empty payloads)."""
        check_body(body, {"serialized_named_tensors": list, "load_format": str,
                          "flush_cache": bool, "abort_all_requests": bool, "weight_version": str,
                          "selector": str, "torch_empty_cache": bool, "rid": str},
                   ("serialized_named_tensors",))
        if not self.session:
            return 400, {"success": False, "message": "update_weights_from_tensor must run "
                         "between begin_weight_update() and end_weight_update()"}
        fmt = body.get("load_format")
        if fmt not in self.args.custom_weight_loader:  # NotImplementedError in SGLang's scheduler
            print(f"Scheduler hit an exception: Unknown load_format={fmt}", file=sys.stderr)
            os._exit(1)
        if len(body["serialized_named_tensors"]) != self.args.tp_size:
            return 400, {"success": False, "message": "one serialized payload per TP rank"}
        if fmt == "qurl.engines.sglang.inside.loader.restore_w8a8":
            self.restored = True
        return 200, {"success": True, "message": "Success"}

    def update_disk(self, body: dict) -> tuple[int, object]:
        from safetensors.torch import load_file

        check_body(body, {"model_path": str, "load_format": str, "abort_all_requests": bool,
                          "weight_version": str, "is_async": bool, "torch_empty_cache": bool,
                          "keep_pause": bool, "recapture_cuda_graph": bool, "token_step": int,
                          "flush_cache": bool, "rid": str}, ("model_path",))
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return 400, {"success": False, "message": "Failed to get weights iterator: no "
                         "safetensors files.", "num_paused_requests": 0}
        for f in files:
            self.weights.update(load_file(str(f)))
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}


def make_handler(app: FakeSGLang):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # keep test output quiet
            pass

        def _send(self, code: int, payload: object) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(payload, bytes)
                             else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = urlparse(self.path).path
            if path in ("/health", "/health_generate"):  # a one-token generation in SGLang
                deadline = time.time() + app.args.health_pause_timeout
                with app.cond:
                    while (app.paused or app.fault == "wedge") and time.time() < deadline:
                        app.cond.wait(deadline - time.time())
                    ok = not app.paused and app.fault != "wedge" and time.time() >= app.ready_at
                self._send(200 if ok else 503, b"")
            elif path == "/model_info":
                self._send(200, {"model_path": app.args.model_path, "weight_version": app.version,
                                 "is_generation": True})
            elif path == "/flush_cache":
                self._send(*app.flush_cache())
            elif path == "/server_info":
                self._send(200, {"quantization": app.args.quantization,
                                 # the fake does not run qurl's in-server sync loader
                                 # (qurl/engines/sglang/inside/apply.py), so it does not list it:
                                 # qurl sends it full, unverified syncs
                                 "custom_weight_loader": [
                                     x for x in app.args.custom_weight_loader
                                     if x != "qurl.engines.sglang.inside.loader.prepare_sync"],
                                 "tp_size": app.args.tp_size, "version": "0.5.23",
                                 # the flag as given (null unless set), the KV pool, and the
                                 # scheduler's effective cap per DP rank (SGLang sizes it from
                                 # the pool when the flag is unset; the fake: 64)
                                 "max_running_requests": app.args.max_running_requests,
                                 "dp_size": 1, "max_total_num_tokens": 8192,
                                 "internal_states": [{"effective_max_running_requests_per_dp":
                                                      app.args.max_running_requests or 64}]})
            elif path == "/_fake/requests":
                self._send(200, app.requests)
            elif path == "/_fake/state":
                self._send(200, {"session": app.session, "restored": app.restored,
                                 "transposed_twice": app.transposed_twice, "paused": app.paused})
            elif path == "/_fake/peak":
                self._send(200, {"peak_running": app.peak_running})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            path = urlparse(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise BadRequest("body must be a JSON object")
                routes = {"/generate": app.generate, "/pause_generation": app.pause,
                          "/continue_generation": app.resume,
                          "/init_weights_update_group": app.init_group,
                          "/destroy_weights_update_group": app.destroy_group,
                          "/begin_weight_update": app.begin, "/end_weight_update": app.end,
                          "/update_weights_from_distributed": app.update_distributed,
                          "/update_weights_from_tensor": app.update_tensor,
                          "/update_weights_from_disk": app.update_disk}
                if path == "/flush_cache":
                    self._send(*app.flush_cache())
                elif path == "/update_weight_version":
                    check_body(body, {"new_version": str, "abort_all_requests": bool, "rid": str},
                               ("new_version",))
                    app.version = body["new_version"]
                    self._send(200, {"success": True, "message": f"Weight version updated to "
                                     f"{app.version}", "new_version": app.version})
                elif path == "/abort_request":
                    check_body(body, {"rid": str, "abort_all": bool})
                    with app.cond:
                        for rid, st in app.running.items():
                            if body.get("abort_all") or rid == body.get("rid"):
                                st["abort"] = True
                    self._send(200, b"")
                elif path == "/_fake/fault":
                    with app.cond:
                        app.fault = body.get("fault")
                        app.cond.notify_all()  # an un-wedged server goes on
                    self._send(200, {"fault": app.fault})
                elif path in routes:
                    self._send(*routes[path](body))
                else:
                    self._send(404, {"detail": "Not Found"})
            except (BadRequest, json.JSONDecodeError) as e:
                self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})

    return Handler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)  # accepted, unused (no GPUs here)
    p.add_argument("--quantization", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--dump-dir", default="")
    p.add_argument("--token-delay", type=float, default=0.002)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--group-timeout", type=float, default=60.0)
    p.add_argument("--die-once-at-bucket-2", default="", metavar="MARKER_FILE")
    p.add_argument("--custom-weight-loader", nargs="*", default=[])
    p.add_argument("--health-pause-timeout", type=float, default=20.0)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    args = p.parse_args(argv)
    if args.tp_size != 1:
        sys.exit("fake_sglang: only --tp-size 1")
    app = FakeSGLang(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(app))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
