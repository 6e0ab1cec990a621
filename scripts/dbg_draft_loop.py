"""Reproduces the fault noted in runtime.draft_loop._body: capture a top-k > 1 draft with the Triton kernels.
    SPLITSPEC_DRAFT_LOOP_TRITON=1 CUDA_LAUNCH_BLOCKING=1 python3 -P scripts/dbg_draft_loop.py TOPK MAX_BS STEPS
DBG_TWINS=rms_norm,draft_topk (names in splitspec.kernels) runs those ops' torch twins, the rest Triton: which kernel
it is."""
import os, sys, torch, traceback, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
from test_gpu_kernels import checkpoint, runner
from splitspec import kernels
from splitspec.kernels import torch_ops
from splitspec.drafter_svc.standalone import StandaloneDrafter
for name in filter(None, os.environ.get("DBG_TWINS", "").split(",")):
    setattr(kernels, name, getattr(torch_ops, name))
path = checkpoint(Path(tempfile.mkdtemp()))
k, max_bs = int(sys.argv[1]), int(sys.argv[2])
d = StandaloneDrafter(runner(path, "flashinfer"), topk=k, num_steps=int(sys.argv[3]), num_draft_tokens=12)
tag = (sys.argv[1:], os.environ.get("SPLITSPEC_KERNELS"), os.environ.get("DBG_TWINS"))
try:
    d.loop.capture(max_bs); torch.cuda.synchronize(); print("RESULT", *tag, "capture ok")
except Exception as e:
    print("RESULT", *tag, "capture FAIL", repr(e)[:200]); traceback.print_exc()
