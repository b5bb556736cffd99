"""A generated coding-agent session: the demo's input and the tests' raw material.

Deterministic for a given seed. It has what compaction must cope with: a system prompt, a
dynamic-context reminder, a pinned instruction, user requests, assistant turns with single and
parallel tool calls, large tool outputs (file views, test logs with tracebacks), a skill read
(``/mnt/skills/.../SKILL.md`` with frontmatter), and planted facts (file paths, exception names,
ticket ids, numbers) that a good summary keeps.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODULES = ["billing/invoice.py", "billing/tax.py", "api/routes.py", "core/ledger.py",
           "core/currency.py", "workers/reconcile.py", "models/customer.py", "utils/retry.py"]
ERRORS = ["InvoiceMismatchError", "LedgerImbalanceError", "CurrencyRoundingError",
          "KeyError", "ZeroDivisionError", "TimeoutError", "ValueError", "IntegrityError"]
WORDS = ["amount", "total", "rate", "customer", "ledger", "entry", "invoice", "currency",
         "rounding", "balance", "payload", "request", "response", "retry", "window", "cursor",
         "batch", "schema", "column", "index", "record"]


@dataclass
class SampleSession:
    messages: list[dict[str, Any]]
    facts: dict[str, list[str]] = field(default_factory=dict)

    def jsonl(self) -> str:
        return "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in self.messages)


def _code_block(rng: random.Random, path: str, lines: int) -> str:
    out = []
    for i in range(1, lines + 1):
        w = rng.sample(WORDS, 3)
        indent = "    " * rng.randint(0, 2)
        out.append(f"{i:5d}  {indent}{w[0]}_{w[1]} = compute_{w[2]}({w[0]}, {rng.randint(0, 999)})")
    return f"[File: {path} ({lines} lines total)]\n" + "\n".join(out)


def _test_log(rng: random.Random, path: str, error: str, ticket: str, lines: int) -> str:
    out = ["============================= test session starts =============================",
           "platform linux -- Python 3.11.7, pytest-8.3.2", f"collected {lines} items", ""]
    for i in range(lines):
        out.append(f"tests/test_{path.split('/')[-1][:-3]}.py::test_case_{i:03d} PASSED")
    out += ["", "=================================== FAILURES ===================================",
            f"___________________________ test_{ticket.lower()} ___________________________",
            "Traceback (most recent call last):",
            f'  File "/repo/{path}", line {rng.randint(20, 400)}, in reconcile',
            "    raise " + error + f"(\"{ticket}: expected 1042.50 got 1042.49\")",
            f"{error}: {ticket}: expected 1042.50 got 1042.49",
            f"=================== 1 failed, {lines - 1} passed in 3.21s ==================="]
    return "\n".join(out)


def coding_session(steps: int = 40, *, seed: int = 7, big_output_lines: int = 220,
                   call_prefix: str = "call") -> SampleSession:
    """A coding session of roughly ``steps`` assistant steps."""
    rng = random.Random(seed)
    facts: dict[str, list[str]] = {"paths": [], "errors": [], "ids": []}
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent working in /repo. Use the "
         "tools to read, edit and test code. Keep changes minimal and explain them."},
        {"role": "system", "content": "Current date: 2026-11-30. Working directory: /repo.",
         "meta": {"dynamic_context_reminder": True}},
        {"role": "user", "content": "House rule: never push to main without a passing test run.",
         "meta": {"pinned": True}},
    ]
    call_n = 0

    def next_id() -> str:
        nonlocal call_n
        call_n += 1
        return f"{call_prefix}_{seed}_{call_n:04d}"

    ticket = f"BILL-{rng.randint(1000, 9999)}"
    facts["ids"].append(ticket)
    msgs.append({"role": "user", "content": f"Ticket {ticket}: invoices for customer "
                 f"CUST-{rng.randint(10000, 99999)} are off by one cent after the currency "
                 "migration. Find the cause, fix it, and make the test suite pass."})
    # A skill read early on: it must survive compaction as a reference.
    skill_id = next_id()
    msgs.append({"role": "assistant", "content": "Loading the debugging skill first.",
                 "tool_calls": [{"id": skill_id, "type": "function", "function": {
                     "name": "read_file",
                     "arguments": json.dumps({"path": "/mnt/skills/debugging/SKILL.md"})}}]})
    msgs.append({"role": "tool", "tool_call_id": skill_id, "name": "read_file", "content":
                 "---\nname: debugging\ndescription: Reproduce first, bisect the change, then "
                 "fix with a regression test.\n---\n# Debugging\n1. Reproduce the failure.\n"
                 "2. Bisect.\n3. Write the regression test before the fix.\n"})
    for step in range(steps):
        path = f"src/{rng.choice(MODULES)}"
        error = ERRORS[step % len(ERRORS)]
        if path not in facts["paths"]:
            facts["paths"].append(path)
        kind = step % 5
        if kind == 0:
            cid = next_id()
            msgs.append({"role": "assistant", "content": f"Let me look at {path}.",
                         "tool_calls": [{"id": cid, "type": "function", "function": {
                             "name": "read_file", "arguments": json.dumps({"path": path})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "name": "read_file",
                         "content": _code_block(rng, path, big_output_lines)})
        elif kind == 1:
            cid = next_id()
            run_ticket = f"RUN-{rng.randint(100000, 999999)}"
            facts["ids"].append(run_ticket)
            if error not in facts["errors"]:
                facts["errors"].append(error)
            msgs.append({"role": "assistant", "content": "Running the tests.",
                         "tool_calls": [{"id": cid, "type": "function", "function": {
                             "name": "bash", "arguments": json.dumps(
                                 {"command": f"pytest -x tests/ --run-id {run_ticket}"})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "name": "bash",
                         "content": _test_log(rng, path, error, run_ticket,
                                              big_output_lines // 2)})
        elif kind == 2:
            a, b = next_id(), next_id()
            other = f"src/{rng.choice(MODULES)}"
            if other not in facts["paths"]:
                facts["paths"].append(other)
            msgs.append({"role": "assistant", "content": "Checking both modules in parallel.",
                         "tool_calls": [
                             {"id": a, "type": "function", "function": {
                                 "name": "bash", "arguments": json.dumps(
                                     {"command": f"grep -n round {path}"})}},
                             {"id": b, "type": "function", "function": {
                                 "name": "bash", "arguments": json.dumps(
                                     {"command": f"git log -3 --oneline -- {other}"})}}]})
            msgs.append({"role": "tool", "tool_call_id": a, "name": "bash", "content":
                         "\n".join(f"{rng.randint(1, 500)}: amount = round(amount, "
                                   f"{rng.randint(0, 4)})" for _ in range(12))})
            msgs.append({"role": "tool", "tool_call_id": b, "name": "bash", "content":
                         "\n".join(f"{rng.getrandbits(28):07x} fix {rng.choice(WORDS)} "
                                   f"in {other}" for _ in range(3))})
        elif kind == 3:
            cid = next_id()
            msgs.append({"role": "assistant", "content": f"Editing {path} to use Decimal "
                         "quantization with ROUND_HALF_EVEN.",
                         "tool_calls": [{"id": cid, "type": "function", "function": {
                             "name": "edit_file", "arguments": json.dumps(
                                 {"path": path, "old": "round(amount, 2)",
                                  "new": "amount.quantize(CENT, ROUND_HALF_EVEN)"})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "name": "edit_file",
                         "content": f"Edited {path}: 1 replacement."})
        else:
            msgs.append({"role": "assistant", "content":
                         f"The {error} comes from {path}: rounding happens before the tax "
                         f"is applied, so {rng.randint(2, 40)} invoices lose a cent. "
                         "I will fix the order of operations next."})
            msgs.append({"role": "user", "content": rng.choice([
                "Sounds right, go ahead.", "Also check the ledger export.",
                "Please keep the public API unchanged.", "What about refunds?"])})
    msgs.append({"role": "user", "content": "Now summarize what you changed and open the PR."})
    return SampleSession(messages=msgs, facts=facts)


def iter_steps(session: SampleSession) -> Iterator[list[dict[str, Any]]]:
    """The session cut into agent steps: an assistant turn with all its tool results, or a
    run of other messages, as a runtime would append them."""
    batch: list[dict[str, Any]] = []
    for message in session.messages:
        if message["role"] == "assistant" and batch:
            yield batch
            batch = []
        batch.append(message)
    if batch:
        yield batch
