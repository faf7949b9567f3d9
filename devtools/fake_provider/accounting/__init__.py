"""A fake accounting API: a real HTTP server for the invoice export (issue 38).

It is the third external system the fence is tested against, beside the Stripe-compatible
fake (`devtools.fake_provider.server`) and the fake Adyen (`devtools.fake_provider.adyen`).
No vendor's API is copied: this is the contract the invoice export is written to, stated
here as a contract (what a client may rely on), not as the fence's convenience. Modules:
`state` (invoices, idempotency keys, faults; no HTTP) and `server` (the HTTP server and
its control API, `FakeAccountingServer`). Started with
`manage.py run_fake_provider --contract accounting --port P --api-key K`.

The contract
------------
JSON in and out. Every `/v1` request carries `Authorization: Bearer <key>`; without a
valid key: `401 {"error": {"code": "unauthorized", ...}}` (nothing executed).

- `POST /v1/invoices` with an `Idempotency-Key` header (1 to 255 printable ASCII
  characters; missing or longer: `400 idempotency_key_invalid`) and the body
  `{"external_id": str, "customer": str, "currency": str (3 letters), "lines":
  [{"description": str, "amount": int}, ...] (at least one), "total": int}`, amounts in
  minor units, `total` the sum of the lines' amounts. A malformed body (not JSON, a
  field missing or of the wrong type, a total that is not the lines' sum):
  `400 {"error": {"code": "invalid_request", "param": ...}}`, nothing executed, nothing
  stored under the key. Else the invoice is created and the answer is `201` with
  `{"id": "inv_...", "external_id", "customer", "status": "open", "total", "currency",
  "lines", "created"}` (`created`: Unix seconds).
- Idempotency. The key names one request for `KEY_RETENTION` seconds after its first use
  (24 hours by default; settable, short for tests). Within it:
  * the same key with the same body (compared as JSON, whatever its spacing or key
    order) does not execute again: the stored answer is replayed, status and body, with
    the header `Idempotent-Replayed: true`;
  * the same key with another body: `422 {"error": {"code": "idempotency_key_reused"}}`,
    nothing executed;
  * the same key while its first request is still being executed:
    `409 {"error": {"code": "request_in_progress"}}`, nothing executed (retry later).
  Past the retention the key is forgotten: the same request executes again and creates
  a second invoice. `external_id` is not unique: two requests under two keys make two
  invoices with the same external id.
- `GET /v1/invoices?external_id=X`: `200 {"data": [invoice, ...]}`, every invoice with that
  external id, oldest first. Consistent: an invoice is listed from the moment its create
  committed (before its answer is sent), never later. Without `external_id`: `400`.
- `GET /v1/invoices/{id}`: `200` the invoice; `404 {"error": {"code": "not_found"}}`.
- No webhooks, no updates, no deletes. Any other path or method: `404`.

Faults (the control API queues them for the next creates, or draws them by rate):
`drop_after_commit` (the invoice is created and its answer stored under the key, then the
socket is closed without a byte: the client sees a reset), `fail_after_commit` (the invoice
is created, and a `500 {"error": {"code": "internal_error"}}` is answered *and stored* under
the key, so a same-key replay gets that 500 again: only the list tells), `hold` (the request
is executed only when `POST /_fake/release` is called or the server stops; its key is in
flight meanwhile: a same-key request gets 409), `slow` (executed at once, the key held in
flight for `slow_delay` seconds, then answered: a client with a shorter read timeout gives
up on a created invoice).

Control API (no auth; JSON in and out), like the other fakes':

- `GET /_fake/health`: `{"status": "ok", "contract": "accounting"}`.
- `GET /_fake/stats`: counters and the config.
- `GET /_fake/invoices`: `{"data": [...]}`, every invoice, oldest first.
- `POST /_fake/faults` `{"mode": "...", "count": N}`: queue faults for the next creates.
- `POST /_fake/release`: let every held request go on; `{"released": N}`.
- `POST /_fake/config`: any `AccountingConfig` field (`api_key`, `key_retention`,
  `slow_delay`, `latency`, `seed`, the `<mode>_rate`s).
- `POST /_fake/reset`: forget invoices, keys, faults and counters.
"""
