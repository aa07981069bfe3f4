"""Served rewards: a reward function behind a URL, posted this script's keywords as JSON, or OpenRLHF's remote reward
protocol; a failed request retried."""
import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import asdict

from ppo_harness.preemption import stop_asked


class ServedReward:
    """--reward-fn URL: an async reward function that POSTs a batch's keywords (a function's, `trainer_state` as a
    dict) as one JSON object and reads back `{"rewards": [one number or null per row]}` or that list alone. A failed
    request (no connection, a timeout, a 5xx) is retried, 1, 2, 4... s apart, unless a signal asked the run to stop.
    OpenRLHF's protocol posts `rows_per_request` rows a request, the requests in parallel."""

    def __init__(self, url: str, timeout: float, retries: int, backoff: float = 1.0, rows_per_request: int = 1):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.rows_per_request = rows_per_request

    def post(self, body: bytes):
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:
            text = reply.read()
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"{self.url} answered with no JSON: {text[:200]!r}") from None

    async def send(self, body: dict, hint: str):
        """The reply to one request, retried; `hint` closes the error when the server failed on the request (it may
        read the other protocol), not when it never answered (a timeout, no connection)."""
        data = json.dumps(body, default=str).encode()
        for attempt in range(self.retries + 1):
            try:
                return await asyncio.to_thread(self.post, data)
            except urllib.error.HTTPError as e:
                error, answered = f"HTTP {e.code}: {e.read()[:200]!r}", True
                if e.code < 500:  # the request itself is wrong: a retry gets the same answer
                    break
            except OSError as e:  # no connection, a reset (the server failed on the request), a timeout
                error, answered = f"{type(e).__name__}: {e}", isinstance(e, ConnectionResetError)
            if stop := stop_asked():  # the scheduler's grace period is short: no retry
                raise ConnectionError(f"{self.url} failed ({error}), not retried: {stop}")
            if attempt < self.retries:
                await asyncio.sleep(self.backoff * 2**attempt)
        raise ConnectionError(f"{self.url} failed after {attempt + 1} tries, the last with {error}"
                              f"{hint if answered else ''}")

    async def __call__(self, prompts, completions, completion_ids, trainer_state=None, log_extra=None,
                       log_metric=None, **columns):
        body = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                    trainer_state=asdict(trainer_state) if trainer_state else None)
        reply = await self.send(body, ". An OpenRLHF reward server (it reads \"query\", \"prompts\" and \"labels\") "
                                      "needs --reward-url-protocol openrlhf")
        return reply.get("rewards") if isinstance(reply, dict) else reply

    async def openrlhf(self, queries, prompts, labels):
        """OpenRLHF's remote reward protocol (its --remote_rm_url): {"query", "prompts", "labels"} posted, as OpenRLHF
        posts them, `rows_per_request` rows a request, the requests in parallel; the replies joined in order."""
        k = self.rows_per_request
        replies = await asyncio.gather(*[self.send(dict(query=queries[i:i + k], prompts=prompts[i:i + k],
                                                        labels=labels[i:i + k]),
                                                   " (posted in OpenRLHF's protocol: --reward-url-protocol openrlhf)")
                                         for i in range(0, len(queries), k)], return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
            if not (isinstance(reply, dict) and ("rewards" in reply or "scores" in reply)):
                raise ValueError(f"{self.url} answered {str(reply)[:200]} with no \"rewards\" or \"scores\", as "
                                 "OpenRLHF's protocol reads them; a server of this script's keywords needs "
                                 "--reward-url-protocol keywords")
        return joined(replies)


def joined(replies: list[dict]) -> dict:
    """OpenRLHF's replies to consecutive rows as one: their `rewards` (else `scores`) and `extra_logs`, in order (a
    value that is no list counts for its request)."""
    def values(value) -> list:
        return list(value) if isinstance(value, (list, tuple)) else [value]

    logs = {}
    for reply in replies:
        for name, logged in (reply.get("extra_logs") or {}).items():
            logs.setdefault(name, []).extend(values(logged))
    return {"rewards": [v for r in replies for v in values(r["rewards"] if "rewards" in r else r["scores"])],
            "extra_logs": logs}


def served(fn) -> bool:
    """Whether a reward function is a server's (`ServedReward`, or OpenRLHF's protocol posted to one)."""
    return isinstance(fn, ServedReward) or isinstance(getattr(getattr(fn, "fn", None), "__self__", None),
                                                      ServedReward)
