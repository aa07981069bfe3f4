"""The environments of ppo_multiturn.py: `--env file.py:Class` (or `module:Class`, or `guess-number`,
the default task's) loaded, one instance per episode, and called through its protocol, sync or async
(an async batch awaited together), every answer checked and a wrong one named with its episode's
row. Two protocols run unchanged:

- this collection's, the smallest that serves: `reset(row) -> str`, the first user message (`row` is
  the dataset row as a dict, so its labels reach the environment), and `step(text) -> (observation,
  reward, done)`, `observation` a str (the next user message) or None, `reward` a number, `done` a
  bool. The script renders each message through the policy's chat template;
- OpenRLHF's agent protocol (`openrlhf/utils/agent.py`, a subclass of its `AgentInstanceBase`, as
  its `--agent_func_path` files hold): `reset({"observation": prompt, "label": label})` returns
  `{"observation": text}` and `step({"observation_text", "action_text", "label", "sampling_params"})`
  returns a dict with `rewards`, `environment_feedback` and `done`. Its texts are appended raw, as
  OpenRLHF's `MultiTurnAgentExecutor` appends them: such an agent writes its own chat formatting.
  OpenRLHF builds the instance with no arguments; an `async def __init__`, which its own example
  has, is awaited."""
import inspect
import math
import numbers
from dataclasses import dataclass

from ppo_harness.event_loop import await_together
from ppo_harness.user_code import import_user_module

BUILTIN_ENVS = {"guess-number": "ppo_harness.guess_number:GuessNumber"}  # the default task


def scalar(value):
    """A 1-element tensor or array (OpenRLHF's examples return tensors) as a Python number, numpy's
    or torch's bool as a bool; anything else as it is (a wrong type is refused by the caller)."""
    try:
        return value.item() if hasattr(value, "item") else value
    except (ValueError, RuntimeError):  # more than one element
        return value


@dataclass
class Episode:
    """One episode's environment instance and what its protocol needs between calls."""
    instance: object
    row: int  # its row in the dataset, for messages
    label: object = None  # OpenRLHF's `label`
    text: str = ""  # OpenRLHF's `observation_text`: the episode's text so far


class Environment:
    """`--env`'s class, checked to have the protocol; `openrlhf`: OpenRLHF's agent protocol (its
    texts appended raw), else this collection's (each message rendered by the chat template)."""

    def __init__(self, spec: str, flag: str = "--env"):
        self.spec, self.flag = spec, flag
        module_name, sep, class_name = BUILTIN_ENVS.get(spec, spec).rpartition(":")
        if not sep or not module_name or not class_name:
            raise ValueError(f"{flag} {spec!r}: expected `path/to/file.py:Class` or `module:Class`")
        module = import_user_module(module_name, flag, spec)
        self.cls = getattr(module, class_name, None)
        if not inspect.isclass(self.cls):
            raise ValueError(f"{flag} {spec!r}: {module_name!r} has no class {class_name!r}")
        self.openrlhf = any(base.__name__ == "AgentInstanceBase" for base in self.cls.__mro__[1:])
        missing = [m for m in ("reset", "step") if not callable(getattr(self.cls, m, None))]
        if missing:
            raise ValueError(f"{flag} {spec!r}: {class_name} has no {' or '.join(missing)} method; an environment "
                             "has reset(row) -> str (the first user message) and step(text) -> (observation, reward, "
                             "done), each sync or async (or OpenRLHF's AgentInstanceBase protocol)")

    def start(self, rows: list[dict], indices: list[int], prompts: list[str] | None = None,
              labels: list | None = None) -> tuple[list[Episode], list[str]]:
        """A fresh instance per row, reset: (the episodes, their first texts: this protocol's first
        user message, or OpenRLHF's observation, raw). `prompts`, `labels`: what OpenRLHF's reset
        gets (the rendered prompt column, the label column)."""
        instances = [obj for obj, _ in self._call([self.cls.__new__(self.cls) for _ in rows],
                                                  lambda obj, i: self.cls.__init__(obj), "__init__", indices)]
        episodes = [Episode(obj, row, labels[i] if labels else None)
                    for i, (obj, row) in enumerate(zip(instances, indices))]
        if self.openrlhf:
            outs = self._call([e.instance for e in episodes],
                              lambda obj, i: obj.reset({"observation": prompts[i], "label": episodes[i].label}),
                              "reset", indices)
            firsts = []
            for (obj, out), e in zip(outs, episodes):
                text = out.get("observation") if isinstance(out, dict) else None
                if not isinstance(text, str):
                    raise ValueError(self._wrong("reset", e.row, out, 'a dict with the str "observation"'))
                e.text = text
                firsts.append(text)
            return episodes, firsts
        outs = self._call([e.instance for e in episodes], lambda obj, i: obj.reset(rows[i]), "reset", indices)
        for (obj, out), e in zip(outs, episodes):
            if not isinstance(out, str):
                raise ValueError(self._wrong("reset", e.row, out, "the first user message, a str"))
        return episodes, [out for _, out in outs]

    def step(self, episodes: list[Episode], texts: list[str]) -> list[tuple[str | None, float, bool]]:
        """Each episode's environment answers its action `texts`: (the observation or None, the
        reward, done). OpenRLHF's `environment_feedback` is the observation (raw text)."""
        rows = [e.row for e in episodes]
        if self.openrlhf:
            states = [{"observation_text": e.text, "action_text": t, "label": e.label, "sampling_params": None}
                      for e, t in zip(episodes, texts)]
            outs = self._call([e.instance for e in episodes], lambda obj, i: obj.step(states[i]), "step", rows)
            answers = []
            for (obj, out), e, t in zip(outs, episodes, texts):
                if not isinstance(out, dict) or not {"rewards", "environment_feedback", "done"} <= set(out):
                    raise ValueError(self._wrong("step", e.row, out, 'a dict with "rewards", "environment_feedback" '
                                                                   'and "done" (OpenRLHF\'s AgentInstanceBase)'))
                answer = self._checked(e.row, (out["environment_feedback"], out["rewards"], out["done"]), out)
                e.text = e.text + t + (answer[0] or "")
                answers.append(answer)
            return answers
        outs = self._call([e.instance for e in episodes], lambda obj, i: obj.step(texts[i]), "step", rows)
        return [self._checked(e.row, out, out) for (obj, out), e in zip(outs, episodes)]

    def _call(self, instances: list, call, method: str, rows: list[int]) -> list[tuple[object, object]]:
        """(instance, what `call(instance, i)` returned) for each, coroutines awaited together; an
        exception named with the episode's row."""
        outs = []
        for i, obj in enumerate(instances):
            try:
                outs.append(call(obj, i))
            except Exception as e:
                for out in outs:  # the coroutines started before it will not be awaited
                    if inspect.iscoroutine(out):
                        out.close()
                raise RuntimeError(f"{self.flag} {self.spec}: {self.cls.__name__}.{method}, in the episode of row "
                                   f"{rows[i]}, raised {type(e).__name__}: {e}") from e
        waiting = [i for i, out in enumerate(outs) if inspect.isawaitable(out)]
        for i, out in zip(waiting, await_together([outs[i] for i in waiting]) if waiting else []):
            if isinstance(out, BaseException):
                raise RuntimeError(f"{self.flag} {self.spec}: {self.cls.__name__}.{method}, in the episode of row "
                                   f"{rows[i]}, raised {type(out).__name__}: {out}") from out
            outs[i] = out
        return list(zip(instances, outs))

    def _checked(self, row: int, out, raw) -> tuple[str | None, float, bool]:
        """`step`'s answer as (observation or None, reward, done); refused unless of those types."""
        expected = "(observation: a str or None, reward: a number, done: a bool)"
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(self._wrong("step", row, raw, expected))
        observation, reward, done = out
        reward, done = scalar(reward), scalar(done)
        if (not (observation is None or isinstance(observation, str)) or not isinstance(reward, numbers.Real)
                or not isinstance(done, bool) or not math.isfinite(float(reward))):
            raise ValueError(self._wrong("step", row, raw, expected + ", the reward finite"))
        return observation, float(reward), bool(done)

    def _wrong(self, method: str, row: int, out, expected: str) -> str:
        return (f"{self.flag} {self.spec}: {self.cls.__name__}.{method}, in the episode of row {row}, returned "
                f"{type(out).__name__} {str(out)[:200]}; expected {expected}")
