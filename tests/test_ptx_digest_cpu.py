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
