"""Inbox: skip messages a consumer has already handled (dedup on (consumer, message id)).

Generic over RQ queues; it knows nothing of the apps that use it. Entry
points: :func:`inbox.handlers.inbox_handler`, :func:`inbox.handlers.inbox_guard`,
:class:`inbox.queues.MessageQueue`, :mod:`inbox.services`; settings in
:mod:`inbox.conf`.
"""
