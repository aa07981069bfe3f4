"""The one event loop a run awaits user code on: async reward functions (`reward_calls`) and async
environments (`environments`), each batch's coroutines awaited together.

The loop runs in a daemon thread, not through asyncio.Runner: TRL's GRPOTrainer runs async reward
functions so (start_event_loop_in_daemon, run_coroutine_threadsafe), and a function written for it
keeps that: its loop keeps running between calls, so a client's background tasks (keep-alive pings,
a pool's clean-up) go on while the run trains, and it is called even where the caller's own thread
already runs a loop (a notebook), where asyncio.Runner.run refuses to start."""
import asyncio
import threading

_event_loop = None
_event_loop_started = threading.Lock()


def await_together(coroutines: list) -> list:
    """Results (or exceptions) of coroutines awaited together (asyncio.gather), as TRL, on one
    event loop kept for the run in a thread of its own: an async client a function keeps between
    calls stays on its loop."""
    global _event_loop
    with _event_loop_started:
        if _event_loop is None:
            _event_loop = asyncio.new_event_loop()
            threading.Thread(target=_event_loop.run_forever, name="reward-functions",
                             daemon=True).start()

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    return asyncio.run_coroutine_threadsafe(gather(), _event_loop).result()
