"""Prompt-lookup (n-gram) drafting for speculative decoding.

The drafter looks for the most recent earlier occurrence of the request's last ``n`` tokens
(``n`` from ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed it. It needs no
model, and on repetitive text (code, quoting, greedy loops) it is often right. Whatever it proposes,
verification keeps only what greedy decoding would have produced.
"""

from __future__ import annotations

__all__ = ["NgramDrafter"]


class NgramDrafter:
    r"""Propose up to ``k`` draft tokens by n-gram lookup in the request's own tokens.

    Args:
        max_ngram (int): longest suffix to match.
        min_ngram (int): shortest suffix to match.
        pad (bool): always return exactly ``k`` tokens, repeating the last token when the lookup
            finds fewer (uniform query lengths let decode steps run as captured CUDA graphs).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, pad: bool = True) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.pad = max_ngram, min_ngram, pad

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Draft tokens to follow ``tokens``.

        Args:
            tokens (list[int]): the request's tokens so far (prompt + output).
            k (int): how many to propose (0 gives []).

        Returns:
            list[int]: at most ``k`` tokens (exactly ``k`` with ``pad`` and non-empty ``tokens``).
        """
        if k <= 0 or not tokens:
            return []
        draft: list[int] = []
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tok - n :]
            # most recent earlier match whose continuation exists
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    draft = tokens[start + n : start + n + k]
                    break
            if draft:
                break
        if self.pad:
            draft = draft + [draft[-1] if draft else tokens[-1]] * (k - len(draft))
        return draft
