"""CPU: tools/ptx_digest.py, the proof that a change to kernels_cu/ leaves the compiled
code as it was -- the same digest for the same source and for a comment added, another
for a changed line of code."""
import pathlib
import shutil
import sys

import pytest

pytest.importorskip("cupy")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import ptx_digest  # noqa: E402

from cufa import _compile  # noqa: E402

KEY = "merge_fp32"


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A copy of the package's kernel sources, compiled instead of them."""
    tree = tmp_path / "kernels_cu"
    shutil.copytree(pathlib.Path(str(_compile.KERNEL_FILES)), tree)
    monkeypatch.setattr(_compile, "KERNEL_FILES", tree)
    monkeypatch.setattr(_compile, "_source_cache", {})
    return tree


def digest():
    _compile._source_cache.clear()
    return ptx_digest.ptx_digest({v.key: v for v in _compile.all_variants()}[KEY])


def test_a_comment_keeps_the_digest_and_code_changes_it(kernels):
    merge = kernels / "decode" / "merge.cu"
    text = merge.read_text()
    before = digest()
    assert digest() == before  # (NVRTC's output is deterministic for one source)
    merge.write_text(text.replace("namespace cufa {", "namespace cufa {\n// a comment\n", 1))
    assert digest() == before  # (the internal symbols' hashed names differ; normalized)
    store = "reinterpret_cast<float*>(base)[i] = x;"  # (merge_fp32's store)
    assert store in text
    merge.write_text(text.replace(store, store.replace("= x;", "= x + 1.f;"), 1))
    assert digest() != before
    assert KEY in ptx_digest.default_keys()  # (the last merge variant: in the default sample)


def test_internal_names_are_one_whatever_the_process():
    """The names NVRTC gives internal symbols carry the source's hash and the compiling
    process's id; with a longer id the mangled length before the name grows too (a
    5-digit and a 6-digit process id once gave every kernel another digest)."""
    one = ".global .u32 _ZN47_INTERNAL_00000000_11_fwd_sm80_cu_aa41d365_22064cufa6kWarpsE;"
    other = ".global .u32 _ZN48_INTERNAL_00000000_11_fwd_sm80_cu_bb41d365_122064cufa6kWarpsE;"
    assert ptx_digest.normalized(one) == ptx_digest.normalized(other)
    assert ptx_digest.normalized(one) != ptx_digest.normalized(one.replace("kWarps", "kLanes"))


PTX_ONE = """.global .align 4 .u32 _ZN4cufa7MlaSmem5kRingE = 73728;
.func  (.param .b32 func_retval0) _ZN4cufa13mla_box_blockEv(
\t.param .b32 p
)
{
\t@%p1 bra \t$L__BB0_2;
$L__BB0_2:
\tret;
}
.visible .entry _ZN4cufa6kernelILi1EEEvv(
)
{
\tcall.uni _ZN4cufa13mla_box_blockEv, ();
\t// begin inline asm
{
\t.reg .pred p;
}
\t// end inline asm
\t@%p1 bra \t$L__BB1_3;
$L__BB1_3:
\tret;
}
"""


PTX_OTHER = """.global .align 4 .u32 _ZN4cufa7MlaSmemILb0EE5kRingE = 73728;
.global .align 4 .u32 _ZN4cufa7MlaSmemILb0EE7kStagesE = 4;
.visible .entry _ZN4cufa6kernelILi1ELb0EEEvv(
)
{
\tcall.uni _ZN4cufa13mla_box_blockILb0EEvv, ();
\t// begin inline asm
{
\t.reg .pred p;
}
\t// end inline asm
\t@%p1 bra \t$L__BB0_3;
$L__BB0_3:
\tret;
}
.func  (.param .b32 func_retval0) _ZN4cufa13mla_box_blockILb0EEvv(
\t.param .b32 p
)
{
\t@%p1 bra \t$L__BB1_2;
$L__BB1_2:
\tret;
}
"""


def test_code_bodies_set_names_labels_order_and_constants_aside():
    """--bodies: a kernel that gained a template flag (another mangled name), its helper
    emitted after it with other label numbers, and a constant declaration more, is the
    same code; a changed instruction is not."""
    assert ptx_digest.code_bodies(PTX_ONE) == ptx_digest.code_bodies(PTX_OTHER)
    assert ptx_digest.code_bodies(PTX_ONE) != ptx_digest.code_bodies(
        PTX_OTHER.replace("ret;", "exit;", 1))
    # (past an inline asm block's braces, the kernel's own last instruction still counts)
    last = PTX_OTHER.rindex("\tret;", 0, PTX_OTHER.index(".func"))
    assert ptx_digest.code_bodies(PTX_ONE) != ptx_digest.code_bodies(
        PTX_OTHER[:last] + "\texit;" + PTX_OTHER[last + 5:])


def test_bodies_tell_one_dtype_from_another():
    """The whole of a compiled kernel's body counts (inline asm braces and all): merge's
    fp16 and fp32 variants differ in their loads and stores, so in their --bodies digests."""
    variants = {v.key: v for v in _compile.all_variants()}
    assert (ptx_digest.ptx_digest(variants["merge_fp16"], bodies=True)
            != ptx_digest.ptx_digest(variants["merge_fp32"], bodies=True))


def test_bodies_of_a_compiled_kernel_by_another_expression(kernels):
    """--as: the same variant compiled by its own name expression and by an equivalent
    one gives one --bodies digest."""
    variant = {v.key: v for v in _compile.all_variants()}[KEY]
    _compile._source_cache.clear()
    mine = ptx_digest.ptx_digest(variant, bodies=True)
    assert ptx_digest.ptx_digest(variant, bodies=True,
                                 expression=variant.name_expression.replace("cufa::", "::cufa::")) == mine


def test_bodies_set_a_grown_params_record_aside():
    """A params record with fields appended (FwdParams gained q_descale) is declared with
    another size, and every old field keeps its offset: the same code. A read at another
    offset is not."""
    entry = (".visible .entry _ZN4cufa6kernelEv(\n\t.param .align 8 .b8 _ZN4cufa6kernelEv_param_0"
             "[424]\n)\n{\n\tld.param.u64 %rd1, [_ZN4cufa6kernelEv_param_0+8];\n\tret;\n}\n")
    grown = entry.replace("[424]", "[448]")
    assert ptx_digest.code_bodies(entry) == ptx_digest.code_bodies(grown)
    assert ptx_digest.code_bodies(entry) != ptx_digest.code_bodies(grown.replace("+8]", "+16]"))


def test_bodies_name_static_shared_variables_by_their_own_names():
    """A function's static __shared__ variable is mangled with the function's template
    arguments; a defaulted argument added (merge_if_last's head count) renames it in every
    body that uses it, which is the same code. Another variable is not."""
    def kernel(local):
        return (".visible .entry _ZN4cufa6kernelEv(\n)\n{\n"
                f"\tmov.u32 \t%r1, {local};\n\tret;\n}}\n")
    old = "_ZZN4cufa13merge_if_lastILi1ELi128ELb0EEEvRKNS_12DecodeParamsEiPfE6s_last"
    new = "_ZZN4cufa13merge_if_lastILi1ELi128ELb0ELi1EEEvRKNS_12DecodeParamsEiPfE6s_last"
    other = "_ZZN4cufa13merge_if_lastILi1ELi128ELb0ELi1EEEvRKNS_12DecodeParamsEiPfE6s_done"
    assert ptx_digest.code_bodies(kernel(old)) == ptx_digest.code_bodies(kernel(new))
    assert ptx_digest.code_bodies(kernel(old)) != ptx_digest.code_bodies(kernel(other))
