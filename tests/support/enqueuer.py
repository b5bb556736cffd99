"""An enqueuer that only records what it was asked to send, for tests of the scheduler's
decisions (which sessions get a run, on which trigger) without a broker."""

from __future__ import annotations

import uuid

from compactd.worker.enqueue import Enqueuer, RunRequest


class RecordingEnqueuer(Enqueuer):
    def __init__(self) -> None:
        super().__init__(app=None)
        self.sent: list[RunRequest] = []

    def send(self, request: RunRequest) -> str:
        task_id = request.task_id or uuid.uuid4().hex
        self.sent.append(request)
        return task_id
