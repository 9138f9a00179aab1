"""IncrementalDetokenizer: a request's output text, grown token by token, and its stop strings.

Decoding token by token is wrong twice over: a multi-byte character can span tokens (its first
token alone decodes to U+FFFD), and tokenizers that mark spaces on the following word (SentencePiece
"▁word") drop the space of a text's first token. So, like vLLM and TGI, each step decodes a short
window ``tokens[prefix_offset:]`` and emits what it adds to ``decode(tokens[prefix_offset:read_offset])``;
text is held back while it ends in U+FFFD (an incomplete character), and the window starts in the
prompt's last tokens so that the first output word gets its space. Special tokens that the text skips
(``skip_special_tokens``) never enter the window: they add no text, and a request that keeps sampling
one (EOS under ``ignore_eos``, or the EOS a finished grammar allows) would otherwise grow the window,
and the two decodes of every step, by a token a step.

Stop strings are searched in the new text plus the ``len(stop) - 1`` characters before it, so a stop
string split across tokens is found; the output is cut before it (or after it with
``include_stop_str_in_output``). Until the output has more than ``min_tokens`` tokens no stop string
is looked for (vLLM's rule: text that ends before then never stops the request). For streaming,
``get_next_output_text`` holds back the last ``len(longest stop) - 1`` characters until the request
finishes, so a stop string is never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from fuseformer.engine.sampling_params import SamplingParams

# Prompt tokens to start the decoding window in (vLLM's value): enough for the leading-space rule.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The output text of one request.

    Args:
        tokenizer: the model's ``Tokenizer`` (or a Hugging Face ``tokenizers.Tokenizer``, whose special
            tokens are then kept in the window).
        prompt_token_ids: the prompt (its last tokens give the first output word its context).
        params: ``stop``, ``skip_special_tokens``, ``include_stop_str_in_output`` and ``min_tokens``
            are used.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop = list(params.stop or [])
        self.skip_special_tokens = params.skip_special_tokens
        # Tokens that decode to nothing here: left out of the window.
        self._skipped = getattr(tokenizer, "special_token_ids", frozenset()) if self.skip_special_tokens else ()
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_string: str | None = None  # the stop string found, once found
        self._streamed = 0  # characters of output_text handed out by get_next_output_text

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        if self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends inside a character: decode the output on its own
        self._tokens = context  # the window's tokens: prompt context, then the output
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def finished(self) -> bool:
        """A stop string was found: the request should finish (FINISHED_STOPPED)."""
        return self.stop_string is not None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add sampled tokens; returns the stop string if one now ends the output, else None.

        Args:
            new_token_ids: the tokens appended this step.
            stop_terminated: the request finished on its last token (EOS or a stop token id); that
                token is then left out of the text unless ``include_stop_str_in_output``.
        """
        if self.finished:
            return self.stop_string
        new_token_ids = list(new_token_ids)
        num_before = len(self.output_token_ids)
        self.output_token_ids.extend(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        min_tokens = self.params.min_tokens
        for j, t in enumerate(new_token_ids):
            before = len(self.output_text)
            if t in self._skipped:
                continue
            self._tokens.append(t)
            self.output_text += self._next_text(flush=False)
            if self.stop and num_before + j >= min_tokens and self._find_stop(before):
                return self.stop_string
        if stop_terminated:
            self.output_text += self._next_text(flush=True)
        return None

    def flush(self) -> str:
        """At the end of the request: emit text held back for an incomplete character (as U+FFFD)."""
        if self.finished:
            return ""
        before = len(self.output_text)
        self.output_text += self._next_text(flush=True)
        if self.stop and len(self.output_token_ids) > self.params.min_tokens:
            self._find_stop(before)
        return self.output_text[before:]

    def get_next_output_text(self, finished: bool) -> str:
        """The text to stream since the previous call. Unless ``finished``, the last
        ``len(longest stop) - 1`` characters are held back, since they may begin a stop string."""
        end = len(self.output_text)
        if not finished and not self.finished and self.stop:
            end = max(self._streamed, end - (max(len(s) for s in self.stop) - 1))
        delta = self.output_text[self._streamed : end]
        self._streamed = end
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _next_text(self, flush: bool) -> str:
        """The text the window's unread tokens add; empty while it would end in an incomplete character."""
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def _find_stop(self, new_from: int) -> bool:
        """Look for a stop string ending after ``output_text[new_from]``; on a hit cut the text and record it."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.params.include_stop_str_in_output else i]
        self._streamed = min(self._streamed, len(self.output_text))
        self.stop_string = s
        return True
