"""Logprobs as the API shows them: the chat and completions formats of sampled
tokens' logprobs, and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from pyagent_framework.engine.outputs import CompletionOutput, RequestOutput
from pyagent_framework.server import protocol as api


class LogprobsMixin:
    """:class:`~pyagent_framework.server.serving.OpenAIServing`'s logprob formatting;
    uses its ``tokenizer``."""

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, output: CompletionOutput, start: int, top: int) -> api.ChoiceLogprobs:
        content = []
        for position in range(start, len(output.logprobs or [])):
            entry = output.logprobs[position]
            chosen = output.token_ids[position]
            text, raw = self._token_text(chosen)
            alternatives = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
            content.append(
                api.TokenLogprob(
                    token=text,
                    logprob=_finite(entry[chosen].logprob),
                    bytes=raw,
                    top_logprobs=[
                        api.TopLogprob(token=t, logprob=_finite(lp.logprob), bytes=b)
                        for lp in alternatives
                        for t, b in [self._token_text(lp.token_id)]
                    ],
                )
            )
        return api.ChoiceLogprobs(content=content)

    def _completion_logprobs(
        self, output: CompletionOutput, start: int, top: int, echo_of: RequestOutput | None, first_offset: int = 0
    ) -> api.CompletionLogprobs:
        result = api.CompletionLogprobs()
        offset = first_offset
        entries: list[tuple[int, dict | None]] = []
        if echo_of is not None:
            prompt_lps = echo_of.prompt_logprobs or [None] * len(echo_of.prompt_token_ids)
            entries.extend(zip(echo_of.prompt_token_ids, prompt_lps))
        entries.extend((output.token_ids[i], output.logprobs[i]) for i in range(start, len(output.logprobs or [])))
        for token_id, entry in entries:
            text, _ = self._token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_finite(entry[token_id].logprob))
            tops = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
            result.top_logprobs.append({self._token_text(lp.token_id)[0]: _finite(lp.logprob) for lp in tops})
        return result

    def _prompt_logprobs(self, req: api.SamplingFields, final: RequestOutput) -> api.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first), the token's own
        logprob and the top ``prompt_logprobs`` alternatives, keyed by token id."""
        if req.prompt_logprobs is None or final.prompt_logprobs is None:
            return None
        out: api.PromptLogprobs = []
        for position, entry in enumerate(final.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            token = final.prompt_token_ids[position]
            out.append(
                {
                    str(lp.token_id): api.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self._token_text(lp.token_id)[0])
                    for lp in entry.values()
                    if lp.token_id == token or lp.rank <= req.prompt_logprobs
                }
            )
        return out


def _finite(value: float) -> float:
    """JSON has no -inf: a token the model gives zero probability gets the lowest float."""
    return value if value > float("-inf") else -9999.0
