"""flash-attn 2's ``bert_padding``: from a padded batch and its mask to the packed (varlen)
form and back, in plain PyTorch ops (gradients flow through them). unpad_input returns
the five values current flash-attn returns; cufa.unpad_input and cufa.pad_input are
cufa's own forms (any framework, four values)."""
import torch


def index_first_axis(input, indices):
    """input[indices]: the rows `indices` (n,) of input (rows, ...) -> (n, ...)."""
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """(first_axis_dim, ...) zeros with row indices[i] = values[i]: index_first_axis
    undone."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def index_first_axis_residual(input, indices):
    """(index_first_axis(input, indices), input as the residual): a gradient reaching
    either flows back into input (flash-attn's residual is a detached alias whose own
    autograd function adds its gradient back; a view does the same)."""
    return index_first_axis(input, indices), input.view_as(input)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of a padded batch, packed.

    hidden_states (batch, seqlen, ...); attention_mask (batch, seqlen), bool or int,
    nonzero = a real token; unused_mask, same shape: tokens allocated but unused, packed
    too. Returns (packed (total, ...), indices (total,) int64 rows of hidden_states seen
    as (batch * seqlen, ...), cu_seqlens int32 (batch + 1,), max_seqlen int, seqused
    int32 (batch,) the real tokens of each sequence). Reading max_seqlen is a sync.
    """
    taken = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = taken.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(taken.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, cu_seqlens, max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packing where a row holds several sequences one after the other:
    attention_mask_in_length (batch, seqlen) lists each row's sequence lengths from the
    left, then zeros (row [2, 3, 0, 0, 0, 0]: sequences of 2 and 3 tokens, one pad).
    Returns (packed, indices, cu_seqlens, max_seqlen) over all those sequences."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    taken = torch.arange(seqlen, device=lengths.device) < lengths.sum(dim=-1, keepdim=True)
    seqlens = lengths.flatten()[lengths.flatten() != 0].to(torch.int32)
    indices = torch.nonzero(taken.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """unpad_input undone: packed (total, ...) -> (batch, seqlen, ...), zeros at padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
