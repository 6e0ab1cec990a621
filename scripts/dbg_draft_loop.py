"""Captures a draft loop (runtime.draft_loop) of a random Llama with the Triton kernels on a GPU: prints RESULT ... capture
ok or FAIL (a top-k > 1 capture once faulted: the RoPE kernel read a stride-0 positions view as contiguous).
    CUDA_LAUNCH_BLOCKING=1 python3 -P scripts/dbg_draft_loop.py TOPK MAX_BS STEPS
DBG_TWINS=rms_norm,draft_topk (names in splitspec.kernels) runs those ops' torch twins, the rest Triton: which kernel
faults (scripts/dbg_draft_loop_bisect.sh tries each)."""
import os, sys, torch, traceback, tempfile
from pathlib import Path
from splitspec import kernels
from splitspec.kernels import torch_ops
from splitspec.drafter_svc.standalone import StandaloneDrafter
for name in filter(None, os.environ.get("DBG_TWINS", "").split(",")):
    setattr(kernels, name, getattr(torch_ops, name))
import transformers
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
path = Path(tempfile.mkdtemp())  # a random Llama of test_gpu_kernels' shape (head_dim 64, four query heads per KV head)
torch.manual_seed(0)
transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=512, intermediate_size=768, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0)).save_pretrained(path)
runner = lambda p: ModelRunner.load(RuntimeConfig(model_path=str(p), dtype="bfloat16", device="cuda", page_size=4,
                                                  max_total_tokens=4096, attention_backend="flashinfer",
                                                  disable_cuda_graph=True, cuda_graph_max_bs=8))
k, max_bs = int(sys.argv[1]), int(sys.argv[2])
d = StandaloneDrafter(runner(path), topk=k, num_steps=int(sys.argv[3]), num_draft_tokens=12)
tag = (sys.argv[1:], os.environ.get("SPLITSPEC_KERNELS"), os.environ.get("DBG_TWINS"))
try:
    d.loop.capture(max_bs); torch.cuda.synchronize(); print("RESULT", *tag, "capture ok")
except Exception as e:
    print("RESULT", *tag, "capture FAIL", repr(e)[:200]); traceback.print_exc()
