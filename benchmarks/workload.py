"""Multi-turn chat and agent conversations for benchmarks: seeded text drawn from a word list.

Every user shares one system prompt and has its own history; each round adds a question (in agent
mode a long tool result and a short question) and then the assistant's answer, so the prompt of
round r is the prompt of round r-1 plus its answer plus the new turn. Lengths are targets in
tokens, turned into word counts with ``tokens_per_word``: approximate by design (benchmarks report
the server's real ``prompt_tokens``). Same config, same text: each user's words come from its own
``random.Random`` seeded with a string, so they do not depend on the order requests run in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common English words: most are one token (with their leading space) in large BPE vocabularies.
_WORD_TEXT = """
the of and to in is that for it as with was on be by at this are from or have an they which one
you were all we her she there can has more when will if no out so what up about into than them
time only would some could other then its now these two may like first also new because any over
after most where know even way well back much years good just those many see people great state
still should such make through between both being under long life last day might part same little
while world own used work down old number case found off often since place made never house point
seen given group head side general each high form school every country water end without light
system before against information right things large around though during cache block memory
engine request stream value table river garden window market paper music story morning evening
city road train letter voice field color answer question reason friend teacher doctor mountain
island forest summer winter bridge kitchen library picture minute season village language
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))

# Chat templates add a few tokens per message (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 6


@dataclass(frozen=True)
class WorkloadConfig:
    """The shape of a multi-turn workload; lengths are approximate token counts."""

    num_users: int
    num_rounds: int
    system_prompt_len: int
    history_len: int
    answer_len: int
    question_len: int = 24
    agentic: bool = False
    tool_result_len: int = 1024
    tokens_per_word: float = 1.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_users < 1 or self.num_rounds < 1:
            raise ValueError("num_users and num_rounds must be at least 1")
        if self.answer_len < 1 or self.question_len < 1:
            raise ValueError("answer_len and question_len must be at least 1")
        if min(self.system_prompt_len, self.history_len, self.tool_result_len) < 0:
            raise ValueError("lengths must be >= 0")
        if not self.tokens_per_word > 0:
            raise ValueError("tokens_per_word must be > 0")

    def turn_len(self) -> int:
        """Approximate tokens one round adds before its answer."""
        tool = self.tool_result_len if self.agentic else 0
        return tool + self.question_len + MESSAGE_OVERHEAD_TOKENS

    def last_prompt_len(self) -> int:
        """Approximate prompt tokens of a user's last round (the longest prompt)."""
        return (self.system_prompt_len + self.history_len + 2 * MESSAGE_OVERHEAD_TOKENS
                + self.num_rounds * self.turn_len()
                + (self.num_rounds - 1) * (self.answer_len + MESSAGE_OVERHEAD_TOKENS))

    def working_set_tokens(self) -> int:
        """Approximate tokens of KV that all users' conversations hold at the end: the shared
        system prompt once, every user's history, turns and answers."""
        per_user = self.last_prompt_len() + self.answer_len - self.system_prompt_len
        return self.system_prompt_len + self.num_users * per_user


def words_text(rng: random.Random, num_tokens: int, tokens_per_word: float) -> str:
    """About `num_tokens` tokens of sentences made of random words ('' for 0)."""
    num_words = round(num_tokens / tokens_per_word)
    sentences = []
    while num_words > 0:
        n = min(num_words, rng.randint(6, 16))
        words = [rng.choice(WORDS) for _ in range(n)]
        sentences.append(" ".join(words).capitalize() + ".")
        num_words -= n
    return " ".join(sentences)


def system_prompt(config: WorkloadConfig) -> str:
    """The system prompt every user shares."""
    rng = random.Random(f"system:{config.seed}")
    return words_text(rng, config.system_prompt_len, config.tokens_per_word)


class Conversation:
    """One user's conversation: call `next_messages()` for a round's prompt, then `add_answer()`.

    Invariant: `messages` alternates user and assistant after the system message, so templates
    that insist on alternation accept it; the initial history rides in the first user message.
    """

    def __init__(self, config: WorkloadConfig, user: int, system_text: str) -> None:
        self.config = config
        self.user = user
        self.round = 0
        self._rng = random.Random(f"user:{config.seed}:{user}")
        self._answer_rng = random.Random(f"answer:{config.seed}:{user}")
        self._history = words_text(self._rng, config.history_len, config.tokens_per_word)
        self.messages: list[dict[str, str]] = []
        if system_text:
            self.messages.append({"role": "system", "content": system_text})
        self._pending: dict[str, str] | None = None

    @property
    def done(self) -> bool:
        return self.round >= self.config.num_rounds

    def next_messages(self) -> list[dict[str, str]]:
        """The prompt of the current round: the conversation so far plus a new user turn."""
        if self.done:
            raise RuntimeError(f"user {self.user} has finished its {self.config.num_rounds} rounds")
        if self._pending is None:
            cfg = self.config
            question = words_text(self._rng, cfg.question_len, cfg.tokens_per_word)
            question = question[:-1] + "?" if question else "?"
            parts = []
            if self.round == 0 and self._history:
                parts.append(f"Our notes so far:\n{self._history}")
            if cfg.agentic:
                tool = words_text(self._rng, cfg.tool_result_len, cfg.tokens_per_word)
                parts.append(f"Tool output (call {self.round + 1}):\n{tool}")
            parts.append(question)
            self._pending = {"role": "user", "content": "\n\n".join(parts)}
        return [*self.messages, self._pending]

    def add_answer(self, text: str | None) -> None:
        """Close the round with the assistant's answer; without one (the request failed), a
        stand-in of about `answer_len` tokens, so the history still grows as it would."""
        if self._pending is None:
            raise RuntimeError("add_answer() before next_messages()")
        if not text:
            text = words_text(self._answer_rng, self.config.answer_len, self.config.tokens_per_word)
        self.messages += [self._pending, {"role": "assistant", "content": text}]
        self._pending = None
        self.round += 1


def make_conversations(config: WorkloadConfig) -> list[Conversation]:
    """One conversation per user over the shared system prompt."""
    shared = system_prompt(config)
    return [Conversation(config, user, shared) for user in range(config.num_users)]
