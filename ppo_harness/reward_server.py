"""Served rewards: a reward function behind a URL, posted this script's keywords as JSON, or
OpenRLHF's remote reward protocol; a failed request retried."""
import asyncio
import json
from dataclasses import asdict

import httpx
import tenacity

from ppo_harness.preemption import stop_asked


class Failure(Exception):
    """One try that failed: what it met (`str`), whether the server answered it (then the request
    itself may be wrong: the protocol's hint applies), and whether another try may fare better."""

    def __init__(self, error: str, answered: bool, retried: bool):
        super().__init__(error)
        self.answered, self.retried = answered, retried


class ServedReward:
    """--reward-fn URL: an async reward function that POSTs a batch's keywords (a function's,
    `trainer_state` as a dict) as one JSON object and reads back `{"rewards": [one number or null
    per row]}` or that list alone. A failed request (no connection, a timeout, a 5xx) is retried,
    1, 2, 4... s apart, unless a signal asked the run to stop. OpenRLHF's protocol posts
    `rows_per_request` rows a request, the requests in parallel."""

    def __init__(self, url: str, timeout: float, retries: int, backoff: float = 1.0,
                 rows_per_request: int = 1):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.rows_per_request = rows_per_request

    def client(self) -> httpx.AsyncClient:
        """A client for one batch's requests and their retries. The timeout bounds the connection
        and each read, as a socket's timeout does; a request waiting for one of the pool's
        connections has none (the requests of one batch queue, as they did in a thread pool)."""
        return httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, pool=None))

    async def post(self, client: httpx.AsyncClient, body: bytes):
        """One try: the reply as JSON, else a `Failure` (a 4xx is the request's own fault, so
        another try would get the same answer) or a ValueError (no JSON: not retried)."""
        try:
            reply = await client.post(self.url, content=body,
                                      headers={"Content-Type": "application/json"})
        except httpx.TimeoutException as e:
            raise Failure(f"TimeoutError: no answer within {self.timeout:g} s "
                          f"({type(e).__name__})", answered=False, retried=True) from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            # the connection closed or reset before an answer: the server failed on the request
            raise Failure(f"{type(e).__name__}: {e}", answered=True, retried=True) from None
        except httpx.TransportError as e:  # no connection
            raise Failure(f"{type(e).__name__}: {e}", answered=False, retried=True) from None
        if reply.status_code >= 400:
            raise Failure(f"HTTP {reply.status_code}: {reply.content[:200]!r}", answered=True,
                          retried=reply.status_code >= 500)
        try:
            return json.loads(reply.content)
        except ValueError:
            raise ValueError(f"{self.url} answered with no JSON: {reply.content[:200]!r}") from None

    async def send(self, client: httpx.AsyncClient, body: dict, hint: str):
        """The reply to one request, retried; `hint` closes the error when the server failed on the
        request (it may read the other protocol), not when it never answered (a timeout, no
        connection)."""
        data = json.dumps(body, default=str).encode()
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, Failure) and e.retried),
            # the scheduler's grace period after SIGTERM is short: no retry once a stop is asked
            stop=lambda state: state.attempt_number > self.retries or stop_asked() is not None,
            wait=tenacity.wait_exponential(multiplier=self.backoff, exp_base=2),  # 1, 2, 4... s
            reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    return await self.post(client, data)
        except Failure as failure:
            if failure.retried and (stop := stop_asked()):
                raise ConnectionError(f"{self.url} failed ({failure}), not retried: "
                                      f"{stop}") from None
            raise ConnectionError(f"{self.url} failed after {attempt.retry_state.attempt_number} "
                                  f"tries, the last with {failure}"
                                  f"{hint if failure.answered else ''}") from None

    async def __call__(self, prompts, completions, completion_ids, trainer_state=None,
                       log_extra=None, log_metric=None, **columns):
        body = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    **columns, trainer_state=asdict(trainer_state) if trainer_state else None)
        async with self.client() as client:
            reply = await self.send(client, body, ". An OpenRLHF reward server (it reads "
                                    "\"query\", \"prompts\" and \"labels\") needs "
                                    "--reward-url-protocol openrlhf")
        return reply.get("rewards") if isinstance(reply, dict) else reply

    async def openrlhf(self, queries, prompts, labels):
        """OpenRLHF's remote reward protocol (its --remote_rm_url): {"query", "prompts", "labels"}
        posted, as OpenRLHF posts them, `rows_per_request` rows a request, the requests in
        parallel; the replies joined in order."""
        k = self.rows_per_request
        hint = " (posted in OpenRLHF's protocol: --reward-url-protocol openrlhf)"
        async with self.client() as client:
            replies = await asyncio.gather(
                *[self.send(client, dict(query=queries[i:i + k], prompts=prompts[i:i + k],
                                         labels=labels[i:i + k]), hint)
                  for i in range(0, len(queries), k)],
                return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
            if not (isinstance(reply, dict) and ("rewards" in reply or "scores" in reply)):
                raise ValueError(f"{self.url} answered {str(reply)[:200]} with no \"rewards\" or "
                                 "\"scores\", as OpenRLHF's protocol reads them; a server of this "
                                 "script's keywords needs --reward-url-protocol keywords")
        return joined(replies)


def joined(replies: list[dict]) -> dict:
    """OpenRLHF's replies to consecutive rows as one: their `rewards` (else `scores`) and
    `extra_logs`, in order (a value that is no list counts for its request)."""
    def values(value) -> list:
        return list(value) if isinstance(value, (list, tuple)) else [value]

    logs = {}
    for reply in replies:
        for name, logged in (reply.get("extra_logs") or {}).items():
            logs.setdefault(name, []).extend(values(logged))
    rewards = [v for r in replies for v in values(r["rewards"] if "rewards" in r else r["scores"])]
    return {"rewards": rewards, "extra_logs": logs}


def served(fn) -> bool:
    """Whether a reward function is a server's (`ServedReward`, or OpenRLHF's protocol posted to
    one)."""
    return isinstance(fn, ServedReward) or isinstance(
        getattr(getattr(fn, "fn", None), "__self__", None), ServedReward)
