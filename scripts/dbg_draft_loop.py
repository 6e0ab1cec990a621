import sys, torch, traceback
sys.path.insert(0, "tests")
from test_gpu_kernels import checkpoint, runner
from splitspec.drafter_svc.standalone import StandaloneDrafter
from pathlib import Path
import tempfile
tmp = Path(tempfile.mkdtemp())
path = checkpoint(tmp)
for backend in ("torch", "flashinfer"):
  for k in (1, 3):
    d = StandaloneDrafter(runner(path, backend), topk=k, num_steps=4, num_draft_tokens=12)
    try:
        d.open("a", list(range(3, 20))); d.open("b", list(range(5, 40)))
        t = d.draft(["a", "b"], [12, 12]); torch.cuda.synchronize()
        print(backend, k, "eager ok", t[0].tokens)
    except Exception as e:
        print(backend, k, "eager FAIL", repr(e)[:300]); traceback.print_exc(); break
    if backend == "flashinfer":
        try:
            d.loop.capture(8); torch.cuda.synchronize(); print(backend, k, "capture ok")
            t2 = d.draft(["a", "b"], [12, 12]); print(t2[0].tokens)
        except Exception as e:
            print(backend, k, "capture FAIL", repr(e)[:300]); traceback.print_exc(); break
