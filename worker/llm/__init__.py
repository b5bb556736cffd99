"""Summarizer models: candidates in order, provider clients, the local summarizer, the fallback.

The orchestration uses :func:`~compactd.worker.llm.candidates.candidate_order` to list who may
summarize a session, :class:`~compactd.worker.llm.pool.ProviderPool` (one per event loop: the
worker process's) for clients, and :func:`~compactd.worker.llm.fallback.summarize` to get the first
summary the policy accepts.

Each is imported from its own module: this package imports none of them, so a process that needs
one small part (``compactd check`` builds one provider; every ``compactd`` command registers it)
does not load the fallback and its retry library with it.
"""
