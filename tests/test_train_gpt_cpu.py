"""bench/train_gpt.py's model and corpus on the CPU: a training comparison means something
only from a sane start (PyTorch's default N(0, 1) embeddings, tied to the head, once
started it at a loss near 500)."""
import math
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import train_gpt  # noqa: E402


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def test_the_first_loss_is_near_a_uniform_guess():
    args = train_gpt.parse_args(["--layers", "2", "--width", "64", "--heads", "2",
                                 "--seqlen", "64", "--batch", "2"])
    torch.manual_seed(0)
    model = train_gpt.build(torch, args, sdpa)
    data = train_gpt.corpus(torch, 2 * 64 + 1, 0)
    x, y = data[:-1].view(2, 64), data[1:].view(2, 64)
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, train_gpt.VOCAB), y.view(-1))
    assert abs(loss.item() - math.log(train_gpt.VOCAB)) < 0.3


def test_positions_matter_and_the_corpus_is_fixed():
    """Rotary positions: a token's logits depend on where the tokens before it sit."""
    args = train_gpt.parse_args(["--layers", "1", "--width", "32", "--heads", "2",
                                 "--seqlen", "16", "--batch", "1"])
    torch.manual_seed(0)
    model = train_gpt.build(torch, args, sdpa)
    x = train_gpt.corpus(torch, 16, 3).view(1, 16)
    assert torch.equal(x, train_gpt.corpus(torch, 16, 3).view(1, 16))
    swapped = x.clone()
    swapped[0, [2, 5]] = x[0, [5, 2]]
    assert not torch.allclose(model(x)[0, -1], model(swapped)[0, -1])


def test_the_report_compares_means_over_seeds():
    args = train_gpt.parse_args(["--seeds", "2", "--steps", "20"])
    runs = {"cufa": [dict(seed=0, losses=[9.0] * 10 + [6.0] * 10, tokens_per_s=1e5),
                     dict(seed=1, losses=[9.0] * 10 + [8.0] * 10, tokens_per_s=1e5)],
            "SDPA cuDNN": [dict(seed=0, losses=[9.0] * 10 + [8.0] * 10, tokens_per_s=2e5),
                           dict(seed=1, losses=[9.0] * 10 + [6.0] * 10, tokens_per_s=None)]}
    assert train_gpt.final_losses(runs) == {"cufa": 7.0, "SDPA cuDNN": 7.0}
    text = train_gpt.report(args, runs, "GPU")
    assert "| 0 | 6.0000 | 8.0000 | 100000 | 200000 |" in text
    assert "| 1 | 8.0000 | 6.0000 | 100000 | - |" in text
    assert "Mean final losses (2 seeds): cufa 7.0000, SDPA cuDNN 7.0000; 0.00 % apart" in text
