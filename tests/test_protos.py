"""The wire contract: generated code is reproducible from scripts/gen_protos.sh, every field is
documented, and the generated modules run on the GPU image's grpcio 1.84.0 / protobuf 7.36.2."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path



REPO = Path(__file__).resolve().parent.parent
PROTOS = sorted((REPO / "protos").glob("*.proto"))
GENERATED = ("verifier_pb2.py", "verifier_pb2.pyi", "verifier_pb2_grpc.py")


def test_generated_code_is_reproducible(tmp_path):
    subprocess.run(["bash", str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, capture_output=True, timeout=600)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (REPO / "protos" / name).read_bytes(), f"{name}: run scripts/gen_protos.sh"


def test_every_field_and_enum_value_is_documented():
    field = re.compile(r"^\s+((optional|repeated)\s+)?[\w.]+\s+\w+\s*=\s*\d+;")
    enum_value = re.compile(r"^\s+[A-Z][A-Z0-9_]*\s*=\s*\d+;")
    declaration = re.compile(r"^\s*(message|enum|service|rpc|oneof)\s")
    for proto in PROTOS:
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if field.match(line) or enum_value.match(line) or declaration.match(line):
                previous = lines[i - 1].strip() if i else ""
                assert previous.startswith("//"), f"{proto.name}:{i + 1} has no comment: {line.strip()}"
    assert PROTOS


def test_messages_round_trip():
    from splitspec.protos import verifier_pb2 as pb

    message = pb.GenerateClientMessage(submit=pb.SubmitRequest(
        request_id="r1", prompt_ids=[1, 2, 3], speculate=True,
        sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=2**63 - 1, max_new_tokens=64,
                                   stop_token_ids=[7])))
    parsed = pb.GenerateClientMessage.FromString(message.SerializeToString())
    assert parsed == message and parsed.WhichOneof("kind") == "submit"
    assert parsed.submit.sampling.HasField("seed") and not pb.SamplingParams().HasField("seed")
    delta = pb.TokenDelta(request_id="r1", token_ids=[5, 6], finish_reason=pb.FINISH_REASON_STOP,
                          speculation=pb.SpeculationCounts(verify_steps=1, draft_tokens=4, accepted_tokens=1,
                                                           accepted_per_position=[1]))
    assert pb.GenerateServerMessage.FromString(pb.GenerateServerMessage(deltas=[delta]).SerializeToString()).deltas[0] == delta


def test_generated_code_runs_on_the_gpu_images_versions(tmp_path):
    """A fresh venv with exactly grpcio 1.84.0 and protobuf 7.36.2 (the GPU image's) imports the
    generated modules and round-trips a message through them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "grpcio==1.84.0", "protobuf==7.36.2"], check=True, capture_output=True, timeout=600)
    package = tmp_path / "pkg" / "splitspec"
    shutil.copytree(REPO / "protos", package / "protos")
    (package / "__init__.py").write_text("")
    script = ("import grpc, google.protobuf\n"
              "from splitspec.protos import verifier_pb2 as pb, verifier_pb2_grpc\n"
              "m = pb.SubmitRequest(request_id='x', prompt_ids=[1, 2])\n"
              "assert pb.SubmitRequest.FromString(m.SerializeToString()) == m\n"
              "assert hasattr(verifier_pb2_grpc, 'VerifierStub')\n"
              "from splitspec.protos import step_pb2 as step\n"
              "d = step.DrafterMessage(sender=step.DrafterIdentity(name='d', session=3), heartbeat=step.Heartbeat(steps=2))\n"
              "assert step.DrafterMessage.FromString(d.SerializeToString()) == d\n"
              "print(grpc.__version__, google.protobuf.__version__)\n")
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, cwd=tmp_path / "pkg", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.84.0", "7.36.2"]
