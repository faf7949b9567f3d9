"""Provider events: signed webhooks (and the listed ones) settle claims in seconds.

`views.provider_webhook` checks the signature, stores the event and answers
200 at once; `jobs.handle_provider_event` handles it behind the inbox
(`handling`), where `events` turns it into provider facts matched to their
claims and `payments.engine.recovery.settle_from_provider` settles them;
`sync.sync_events` catches up on events missed while the endpoint was down.
"""
