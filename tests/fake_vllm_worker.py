"""A stand-in for inference_eval/vllm_worker.py's process, speaking its protocol without vLLM
(tests/test_vllm_protocol.py): the ready line (with the cores it may run on, as the real worker's), then one reply
per request line, in order. A request `{"n": i, "sleep": s}` is answered `{"ok": true, "n": i}` after s seconds;
`{"fail": "why"}` with `{"ok": false, "error": "why"}`; `{"exit": code}` ends the process without a reply."""

import json
import os
import sys
import time

print(json.dumps({"ready": True, "vllm": "0.32.0", "layer_ids": [], "cpus": sorted(os.sched_getaffinity(0))}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if "exit" in req:
        sys.exit(int(req["exit"]))
    if "fail" in req:
        print(json.dumps({"ok": False, "error": req["fail"]}), flush=True)
        continue
    time.sleep(float(req.get("sleep", 0)))
    print(json.dumps({"ok": True, "n": req["n"]}), flush=True)
