"""Private torch APIs live in megapipe/_torch_compat.py, each behind one named function.

Each wrapper is called here on small inputs and its result checked, so a torch upgrade that moves
or changes one fails here with the torch version and the API named. A scan of the library's
syntax trees keeps every other module off private torch names; planted files show it catches
them.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
COMPAT = "megapipe/_torch_compat.py"


@contextlib.contextmanager
def api(name: str):
    """A failure inside names the torch version and the private API to update."""
    try:
        yield
    except (AttributeError, ImportError, TypeError, RuntimeError, NotImplementedError) as e:
        pytest.fail(
            f"torch {torch.__version__}: {name} is gone or changed ({type(e).__name__}: {e}); "
            f"update {COMPAT}"
        )


def expect(ok: bool, name: str, what: str) -> None:
    if not ok:
        pytest.fail(f"torch {torch.__version__}: {name} {what}; update {COMPAT}")


@pytest.fixture(scope="module")
def compat():
    """The module itself: its imports of private torch modules are the first thing to move."""
    with api("an import in megapipe/_torch_compat.py"):
        return importlib.import_module("megapipe._torch_compat")


@pytest.fixture
def world_of_one():
    """A one-process gloo group in this process (no spawn), destroyed after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- each wrapper


def test_storage_use_count(compat):
    name = "torch._C._storage_Use_Count(storage._cdata)"
    t = torch.zeros(6)
    with api(name):
        alone = compat.storage_use_count(t)
    view = t.view(2, 3)
    with api(name):
        shared = compat.storage_use_count(t)
    del view
    expect((alone, shared) == (2, 3), name, f"counts {alone}, {shared} (expected 2, then 3)")


def test_view_base(compat):
    t = torch.zeros(6)
    with api("Tensor._base"):
        got = (compat.view_base(t), compat.view_base(t.view(2, 3)))
    expect(got[0] is None and got[1] is t, "Tensor._base", "no longer gives a view's base")


def test_run_backward_skips_the_shape_check(compat):
    name = "torch.autograd.Variable._execution_engine.run_backward"
    x = torch.arange(3.0, requires_grad=True)
    y = x * 2
    y.data = torch.empty(1)  # a released output (parallel/autograd/outputs.py): its shape gone
    with api(name):
        compat.run_backward((y,), (torch.ones(3),))
    expect(torch.equal(x.grad, torch.full((3,), 2.0)), name, f"gave grad {x.grad}")


def test_queue_backward_callback_runs_at_the_end_of_backward(compat):
    name = "torch.autograd.Variable._execution_engine.queue_callback"
    x = torch.arange(3.0, requires_grad=True)
    seen = []

    def hook(grad):  # inside the backward: queue, and the callback must not have run yet
        with api(name):
            compat.queue_backward_callback(lambda: seen.append(x.grad is not None))
        seen.append("hook")

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    expect(seen == ["hook", True], name, f"ran as {seen} (expected after the grads)")


def test_foreach_norm_and_mul(compat):
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    with api("torch._foreach_norm"):
        norms = compat.foreach_norm([a, b], torch.float32)
    expect([float(n) for n in norms] == [5.0, 5.0], "torch._foreach_norm", f"gave {norms}")
    with api("torch._foreach_mul_"):
        compat.foreach_mul_([a, b], torch.tensor(0.5))
    expect(a.tolist() == [1.5, 2.0] and b[1, 1] == 2.0, "torch._foreach_mul_", "did not scale")


def test_grouped_mm(compat):
    name = "torch._grouped_mm"
    with api(name):
        has = compat.has_grouped_mm()
    expect(has, name, "is missing")
    x = torch.arange(12.0).view(3, 4)  # rows 0 | (none) | 1, 2
    w = torch.stack([torch.eye(4), torch.zeros(4, 4), 2 * torch.eye(4)])
    offs = torch.tensor([1, 1, 3], dtype=torch.int32)
    with api(name):
        y = compat.grouped_mm(x, w, offs)
        gw = compat.grouped_mm(x.t(), x, offs)  # (4, 3) · (3, 4), groups along the 3
    want = torch.cat([x[:1], 2 * x[1:]])
    expect(torch.equal(y, want), name, f"gave {y} (expected {want})")
    want = torch.stack([x[:1].t() @ x[:1], torch.zeros(4, 4), x[1:].t() @ x[1:]])
    expect(torch.equal(gw, want), name, f"gave the split-contraction {gw} (expected {want})")


def test_muon_orthogonalize_and_adjusted_lr(compat):
    name = "torch.optim._muon._zeropower_via_newtonschulz"
    g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with api(name):
        o = compat.muon_orthogonalize(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    s = torch.linalg.svdvals(o.float())  # quintic NS: singular values near 1, not exactly
    expect(o.shape == g.shape and bool(((s > 0.5) & (s < 1.5)).all()), name, f"gave {s}")
    name = "torch.optim._muon._adjust_lr"
    with api(name):
        lr = compat.muon_adjusted_lr(0.1, "match_rms_adamw", (16, 4))
        lr0 = compat.muon_adjusted_lr(0.1, "original", (16, 4))
    expect(abs(lr - 0.2 * 0.1 * 4) < 1e-12 and abs(lr0 - 0.2) < 1e-12, name, f"{lr}, {lr0}")


def test_scaled_mm(compat):
    """Small integers are exact in e4m3 and e5m2: tensorwise and rowwise scales, exactly."""
    name = "torch._scaled_mm"
    a = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    b = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, -2.0]])  # (K, N)
    qa = a.to(torch.float8_e4m3fn)
    qb = b.t().contiguous().to(torch.float8_e5m2).t()  # column-major
    sa, sb = torch.tensor([[0.5], [2.0]]), torch.tensor([[1.0, 4.0, 0.25]])
    with api(name):
        whole = compat.scaled_mm(qa, qb, torch.tensor(0.5), torch.tensor(2.0))
        rows = compat.scaled_mm(qa, qb, sa, sb)
    expect(torch.equal(whole, a @ b), name, f"gave {whole} (expected {a @ b})")
    expect(torch.equal(rows, sa * (a @ b) * sb), name, f"gave rowwise {rows}")


def test_fused_adamw_devices(compat):
    name = "torch.utils._foreach_utils._get_fused_kernels_supported_devices"
    with api(name):
        devices = compat.fused_adamw_devices()
    expect({"cpu", "cuda"} <= devices, name, f"lists {sorted(devices)} (cpu and cuda expected)")


def test_flatten_mesh_and_group_timeout(compat, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    with api("DeviceMesh._flatten"):
        flat = compat.flatten_mesh(mesh, ("dp", "cp"), "dp_cp")
    expect(flat.mesh_dim_names == ("dp_cp",), "DeviceMesh._flatten", f"named {flat}")
    group = dist.new_group([0])
    with api("torch.distributed.distributed_c10d._set_pg_timeout"):
        compat.set_group_timeout(group, datetime.timedelta(seconds=7))
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    expect(timeout == datetime.timedelta(seconds=7), "_set_pg_timeout", f"left {timeout}")


def test_flight_recorder_trace_and_group_ranks(compat, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # before the group exists, as launch does
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0], group_desc="mine")
        dist.all_reduce(torch.ones(3, 2), group=group)
        name = "torch._C._distributed_c10d._dump_fr_trace_json"
        with api(name):
            entries = compat.flight_recorder_trace().get("entries", [])
        mine = [e for e in entries if e["process_group"][1] == "mine"]
        expect(len(mine) == 1, name, f"recorded {entries}")
        e = mine[0]
        got = (e["profiling_name"], e["input_sizes"], e["collective_seq_id"], e["retired"])
        expect(got == ("gloo:all_reduce", [[3, 2]], 1, True), name, f"recorded {e}")
        name = "torch.distributed.distributed_c10d._world.pg_names"
        with api(name):
            groups = compat.process_group_ranks()
        expect(groups.get(e["process_group"][0]) == ("mine", [0]), name, f"gave {groups}")
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Please use DTensor:FutureWarning")
def test_sharded_tensor_and_narrow(compat, world_of_one):
    name = "ShardedTensor._init_from_local_shards (with Shard, ShardMetadata)"
    whole = torch.arange(12.0).view(4, 3)
    blocks = [([0, 0], whole[:1]), ([1, 0], whole[1:])]
    with api(name):
        st = compat.sharded_tensor(blocks, (4, 3), dist.group.WORLD)
    shards = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in st.local_shards()]
    expect(st.size() == (4, 3), name, f"made size {st.size()}")
    expect(shards == [([0, 0], [1, 3]), ([1, 0], [3, 3])], name, f"made shards {shards}")
    name = "torch.distributed._shard._utils.narrow_tensor_by_index"
    with api(name):
        part = compat.narrow_to_block(whole, [1, 1], [2, 2])
    expect(torch.equal(part, whole[1:3, 1:3]), name, f"cut {part}")


def _qkv(device="cpu", dtype=torch.float32, hkv=2):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 16, generator=gen) for h in (4, hkv, hkv))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def test_flash_attention_cpu(compat):
    from megapipe.parallel.context.kernels import reference_forward

    name = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
    q, k, v = _qkv()
    with api(name):
        out, lse = compat.flash_attention_cpu(q, k, v, True, 0.25)
    ref_out, ref_lse = reference_forward(q, k, v, True, 0.25)
    expect(torch.allclose(out, ref_out.float(), atol=1e-5), name, "gave another output")
    expect(torch.allclose(lse, ref_lse.float(), atol=1e-5), name, "gave another log-sum-exp")
    name += "_backward"
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(out)
    torch.autograd.backward(reference_forward(qr, kr, vr, True, 0.25)[0].float(), dout)
    with api(name):
        grads = compat.flash_attention_cpu_backward(dout, q, k, v, out, lse, True, 0.25)
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad), strict=True):
        expect(torch.allclose(got, ref.float(), atol=1e-4), name, "gave other gradients")


def test_flash_attention_cuda_signature(compat):
    """The CUDA ops' arguments, bound on meta tensors (no GPU here): a changed signature fails
    here; the values are checked on a GPU by the test below."""
    q, k, v = _qkv("meta", torch.bfloat16, hkv=4)
    name = "torch.ops.aten._scaled_dot_product_flash_attention"
    with api(name):
        out, lse = compat.flash_attention_cuda(q, k, v, True, 0.25)
    expect(out.shape == q.shape and lse.shape == q.shape[:3], name, "returns other shapes")
    name += "_backward"
    with api(name):
        grads = compat.flash_attention_cuda_backward(out, q, k, v, out, lse, True, 0.25)
    expect([g.shape for g in grads] == [q.shape] * 3, name, "returns other shapes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_attention_cuda_values(compat):
    from megapipe.parallel.context.kernels import reference_forward

    q, k, v = _qkv("cuda", torch.bfloat16, hkv=4)
    with api("torch.ops.aten._scaled_dot_product_flash_attention"):
        out, lse = compat.flash_attention_cuda(q, k, v, True, 0.25)
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), True, 0.25)
    assert torch.allclose(out.double(), ref_out, atol=3e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)


def test_cudnn_attention_cuda_signature(compat):
    """The cuDNN ops' arguments, bound on meta tensors: a changed signature or lse shape fails
    here (the wrapper gives the flash kernel's (B, H, Tq)); values on a GPU below."""
    q, k, v = _qkv("meta", torch.bfloat16, hkv=4)
    name = "torch.ops.aten._scaled_dot_product_cudnn_attention"
    with api(name):
        out, lse = compat.cudnn_attention_cuda(q, k, v, True, 0.25)
    expect(out.shape == q.shape and lse.shape == q.shape[:3], name, "returns other shapes")
    expect(lse.dtype == torch.float32, name, "returns an lse not in float32")
    name += "_backward"
    with api(name):
        grads = compat.cudnn_attention_cuda_backward(out, q, k, v, out, lse, True, 0.25)
    expect([g.shape for g in grads] == [q.shape] * 3, name, "returns other shapes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_attention_cuda_values(compat):
    """Natural-log lse and out of whole causal attention, as the flash wrapper's."""
    from megapipe.parallel.context.kernels import reference_forward

    q, k, v = _qkv("cuda", torch.bfloat16, hkv=4)
    with api("torch.ops.aten._scaled_dot_product_cudnn_attention"):
        out, lse = compat.cudnn_attention_cuda(q, k, v, True, 0.25)
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), True, 0.25)
    assert torch.allclose(out.double(), ref_out, atol=3e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)


def test_fake_world_and_fake_tensors(compat):
    """The fake backend takes any rank of any world; a dispatch mode under fake tensors sees
    the c10d op on its boxed group, answers `.item()`, and keys views by one storage."""
    with api("FakeStore / FakeTensorMode / TorchDispatchMode / ProcessGroup.unbox"):
        dist.init_process_group("fake", store=compat.fake_store(), rank=5, world_size=4096)
        seen = []

        class Seen(compat.dispatch_mode_base()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is compat.local_scalar_op():
                    return 7.0
                if func.namespace == "c10d":
                    seen.append(compat.unbox_group(args[1]))
                return func(*args, **(kwargs or {}))

        try:
            with compat.fake_tensor_mode(), Seen():
                x = torch.ones(4, 4)
                dist.all_reduce(x)
                expect(x.sum().item() == 7.0, "aten._local_scalar_dense", "is not seen")
                expect(compat.storage_key(x[1]) == compat.storage_key(x), "_cdata", "differs")
        finally:
            dist.destroy_process_group()
    expect(len(seen) == 1 and seen[0] is not None, "c10d allreduce_", "is not seen boxed")


def test_real_mode_leaves_the_fake_mode(compat):
    """Inside real_mode a tensor made under a fake mode is a real one, with its values."""
    with api("unset_fake_temporarily"), compat.fake_tensor_mode():
        with compat.real_mode():
            real = torch.arange(3)
            expect(real.tolist() == [0, 1, 2], "unset_fake_temporarily", "keeps tensors fake")
        fake = torch.arange(3)
    expect(type(real) is torch.Tensor and type(fake) is not torch.Tensor, "FakeTensor", "same")


def test_is_fake(compat):
    """is_fake tells a fake mode's tensors from real ones."""
    real = torch.ones(2)
    with api("torch._subclasses.fake_tensor.is_fake"), compat.fake_tensor_mode():
        fake = torch.ones(2)
        answers = (compat.is_fake(fake), compat.is_fake(real))
    expect(answers == (True, False), "is_fake", f"gave {answers} for (fake, real)")


def test_cpu_attention_flops(compat):
    """FlopCounterMode counts the CPU flash ops with the given formulas."""
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with api("aten._scaled_dot_product_flash_attention_for_cpu flops"):
        counter = FlopCounterMode(display=False, custom_mapping=compat.uncounted_flops())
        with counter:
            out = compat.flash_attention_cpu(q, q, q, True, 0.5)[0]
            out.sum().backward()
    forward = 4 * 1 * 2 * 8 * 8 * 4  # two (8 x 8) x 4 matmuls per head, 2 FLOPs a MAC
    expect(counter.get_total_flops() == forward * 7 // 2, "the cpu flash flops", "changed")


# ---------------------------------------------------------------- nothing else touches them

SCANNED = ("megapipe", "models", "tools", "benchmarks")  # and train.py, beside them

TORCH_PRIVATE_ATTRIBUTES = {  # private names read off torch objects held in other variables
    "_base", "_cdata", "_execution_engine", "_flatten", "_init_from_local_shards",
    "_local_tensor", "_set_pg_timeout", "_storage_Use_Count",
}  # fmt: skip


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each use of a private torch name: an import of one (`from torch._x`,
    `from torch.y import _z`), an attribute chain from a name bound to torch or to something
    imported from it with a private component (`torch._C.f`, `dist._x`, `torch.ops.aten._op`),
    or a known private torch attribute on any object (`t._base`, `mesh._flatten`)."""
    tree, found, torch_names = ast.parse(source), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    if any(map(_private, a.name.split("."))):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if any(map(_private, [*node.module.split("."), a.name])):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, root = [node.attr], node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        dotted = ".".join([getattr(root, "id", "…"), *reversed(chain)])
        from_torch = isinstance(root, ast.Name) and root.id in torch_names
        if (from_torch and any(map(_private, chain))) or node.attr in TORCH_PRIVATE_ATTRIBUTES:
            found.append((node.lineno, dotted))
    # a chain is reported once, at its longest
    return sorted({(ln, w) for ln, w in found if not any(o.startswith(w + ".") for _, o in found)})


def library_files(root: Path) -> list[Path]:
    files = [p for package in SCANNED for p in sorted((root / package).rglob("*.py"))]
    return [p for p in files + [root / "train.py"] if p != root / COMPAT]


def scan(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line}: {what}"
        for path in library_files(root)
        for line, what in private_torch_uses(path.read_text())
    ]


def test_no_library_module_but_torch_compat_touches_a_private_torch_name():
    found = scan(ROOT)
    assert not found, f"private torch APIs outside {COMPAT} (add a wrapper there):\n" + "\n".join(
        found
    )


PLANTED = """
    import torch
    import torch.distributed as dist
    import torch._dynamo
    from torch import nn
    from torch.utils._foreach_utils import helper
    from torch.distributed.distributed_c10d import _set_pg_timeout

    n = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    dist._private_thing()
    nn.Module._call_impl
    if out._base is not None:
        mesh._flatten("dp_cp")
    ok = (torch.float32, torch.__version__, self._private, dist.get_rank(), nn.Linear)
"""


def test_planted_private_uses_are_caught(tmp_path):
    (tmp_path / "megapipe").mkdir()
    (tmp_path / "megapipe" / "planted.py").write_text(textwrap.dedent(PLANTED))
    (tmp_path / "train.py").write_text("import torch\n")
    found = scan(tmp_path)
    expected = [
        "import torch._dynamo",
        "from torch.utils._foreach_utils import helper",
        "_set_pg_timeout",
        "torch._C._storage_Use_Count",
        "._cdata",
        "torch.ops.aten._scaled_dot_product_flash_attention",
        "dist._private_thing",
        "nn.Module._call_impl",
        "out._base",
        "mesh._flatten",
    ]
    for what in expected:
        assert any(what in line for line in found), (what, found)
    clean = textwrap.dedent(PLANTED).splitlines().index(PLANTED.splitlines()[-1].strip()) + 1
    assert not [line for line in found if f"planted.py:{clean}:" in line], found
