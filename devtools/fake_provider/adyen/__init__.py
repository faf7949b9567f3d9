"""A fake Adyen Checkout API: a real HTTP server that keeps Adyen's documented contract.

It is the second payment provider the fence is tested against (issue 38), beside the
Stripe-compatible fake of `devtools.fake_provider.server`. It follows Adyen's contract,
not the fence's convenience: in particular it offers **no API to look a payment up** by
reference or by `pspReference` (the Checkout API has none: its OpenAPI specification,
Adyen/adyen-openapi `json/CheckoutService-v72.json`, has no `GET /payments/...` path).
A lost answer is settled by a same-key replay while the key is kept, by the signed
notification, or by a person with a report.

Modules: `contract` (the facts below, as constants and error bodies), `parsing` (the
required fields), `ledger` (a payment and the accounting rules of its modifications),
`state` (payments, idempotency keys, faults; no HTTP), `notifications` (HMAC-signed
standard webhooks, retried until accepted), `server` (the HTTP server and its control
API, `FakeAdyenServer`). Started with `manage.py run_fake_provider --contract adyen`.

API (`POST` only, JSON in and out, under `/v72`):

- `POST /v72/payments`: `merchantAccount`, `amount` {`value`, `currency`}, `reference`,
  `paymentMethod`, `returnUrl` (all required), `additionalData`. Answers 200 with
  `pspReference`, `resultCode` (`Authorised`, `Refused` or `Error`), `merchantReference`,
  `amount`, and for a refusal `refusalReason` and `refusalReasonCode`. Test refusals as
  Adyen's test platform triggers them: `paymentMethod.holderName` (`DECLINED`,
  `CARD_EXPIRED`, `NOT_ENOUGH_BALANCE`, ...) or `additionalData.RequestedTestAcquirerResponseCode`
  (`2`, `6`, `12`, ...), see `contract.TEST_OUTCOMES`. Capture is immediate unless the
  merchant account captures manually (`capture="manual"` in the config) or the payment
  asks for it (`additionalData.manualCapture: "true"`).
- `POST /v72/payments/{pspReference}/captures` (`merchantAccount`, `amount`, `reference`),
  `/refunds` (`merchantAccount`, `amount`, `reference`, `merchantRefundReason`) and
  `/cancels` (`merchantAccount`, `reference`): asynchronous modifications, answered
  `201` with `status: "received"`, their own `pspReference` and `paymentPspReference`.
  The outcome comes only in a notification (`CAPTURE`, `REFUND`, `CANCELLATION`, with
  `success` `"true"` or `"false"` and a `reason`).
- Authentication: `X-API-Key` (401 `000` without a valid one); a `merchantAccount` the
  key may not use is 403 `901 Invalid Merchant Account`.
- Idempotency: the `Idempotency-Key` header (at most 64 characters), echoed on every
  answer to a keyed request. Keys are kept `key_retention` seconds (default 7 days) for
  the whole company account this fake stands for. A same-key request replays the stored
  answer; one while the first is still in flight gets `409` (or `422`, `in_flight_status`)
  `704 "request already processed or in progress"` with `transient-error: true`. A same
  key with another body or endpoint replays the first answer too (`key_reuse="replay"`,
  the default) or is refused like an in-flight one (`key_reuse="reject"`); either way it
  is counted (`stats()["key_reuse_other_body"]`).

Notifications: with a notification URL and a hex HMAC key, every AUTHORISATION, CAPTURE,
REFUND and CANCELLATION is POSTed as a standard webhook (`{"live": "false",
"notificationItems": [{"NotificationRequestItem": {...}}]}`), signed in
`additionalData.hmacSignature`, and retried on Adyen's schedule until the endpoint
answers a 2xx whose body contains `[accepted]` (or any 2xx: `accept="2xx"`).

Faults (queued or by rate, on payments and modifications alike): `drop_after_accept`,
`slow`, `fail_before`, `fail_after`, `key_store_unavailable`. Control API under
`/_fake/`: `health`, `stats`, `timeline`, `reset`, `faults`, `config`, `notifications`.

Where each fact comes from
--------------------------
- Version `v72`, base URL, paths, `X-API-Key`: the Adyen 16.0.0 library
  (`Adyen/services/checkout/payments_api.py` and `modifications_api.py`:
  `baseUrl = "https://checkout-test.adyen.com/v72"`, `/payments`,
  `/payments/{paymentPspReference}/captures|refunds|cancels`; `Adyen/httpclient.py`
  sends the key as `x-api-key`) and the OpenAPI specification's description. The
  library's README ("Customizing Base URL": replace the service's `baseUrl`) is how the
  tests point it at this fake.
- Request and answer fields, required fields, `status: "received"`, 201 for
  modifications, the `resultCode` values, the `ServiceError` shape (`status`,
  `errorCode`, `message`, `errorType`, `pspReference`): `CheckoutService-v72.json`.
- Modifications are asynchronous, outcome in CAPTURE / REFUND / CANCELLATION
  webhooks; a partial capture releases the rest; refunds may be partial as long as
  their sum does not exceed the captured amount; a capture of an automatically
  captured payment does not charge twice: the same specification's descriptions of
  the three endpoints, and docs.adyen.com/development-resources/api-idempotency
  (its "accounting rules" paragraph). Automatic capture is the default; manual capture
  is set per merchant account or per transaction: docs.adyen.com/online-payments/capture
  and /point-of-sale/capturing-payments (the `manualCapture` field name is the one
  integrations send in `additionalData`; the page does not spell it).
- Test refusals (`holderName` / `RequestedTestAcquirerResponseCode`, `resultCode`,
  `refusalReason`, the codes): docs.adyen.com/development-resources/testing/result-codes
  and /development-resources/refusal-reasons ("trigger these refusal reasons in our test
  environment by their refusalReasonCode values").
- Idempotency: docs.adyen.com/development-resources/api-idempotency: header
  `idempotency-key`, at most 64 characters, case-insensitive headers; "If the Adyen
  payments platform already processed the request, the response to the first attempt
  will be returned"; the key echoed in the answer; "Keys are stored at a company account
  level ... valid for a minimum period of 7 days after first submission" (an older
  version of the page said 31 days, "but may be retained for longer"); a duplicate before the first completed
  gets "HTTP 422 – Unprocessable Entity or HTTP 409 - Conflict ... error code 704:
  'request already processed or in progress'", a transient error carries
  `transient-error: true`; the key store unavailable is "HTTP 503 ... 703: 'required
  resource temporarily unavailable'". The page says nothing about a same key with
  another body: hence `key_reuse`, "replay" by default (what the page describes).
- Error bodies: the specification's own examples (`components/examples/generic-400`,
  `-401`, `-403`, `-422`: 400 `702` "Unexpected input", 401 `000` "HTTP Status Response -
  Unauthorized" (errorType `security`, no pspReference), 403 `901` "Invalid Merchant
  Account", 422 `14_030` "Return URL is missing."); the library's fixtures
  (adyen-python-api-library `test/mocks/`): `payments-error-invalid-data-422.json` (422
  `130 Reference Missing`), `capture-error-167.json` (422 `167 Original pspReference
  required for this operation`); docs.adyen.com/development-resources/error-codes (`100
  Required object 'amount' is not provided`). Status codes map to the library's
  exceptions in `Adyen/client.py` `_raise_http_error` (409 and 503 raise its generic
  `AdyenAPIResponseError`).
- Notifications: `json/Webhooks-v1.json` (NotificationRequest / NotificationRequestItem,
  `success` and `live` are strings, `originalReference` for modifications);
  docs.adyen.com/development-resources/webhooks/verify-hmac-signatures and the library's
  `Adyen/util.py` (`generate_notification_sig`: `pspReference:originalReference:
  merchantAccountCode:merchantReference:value:currency:eventCode:success`, HMAC-SHA256
  with the hex-decoded key, base64); acceptance by a body containing `[accepted]`, or
  any 2xx since 2024: adyen.com/knowledge-hub/webhooks-accept-2xx (accept within 10 s);
  retries: docs.adyen.com/development-resources/webhooks/troubleshoot (three retries 9 s
  apart, then 2, 5, 10, 15, 30 min, 1, 2, 4, 8 h, for up to 30 days, one queue per
  endpoint, the next webhook after a successful retry).

The fake's own choices (no Adyen source says otherwise, none says so either): which 422
answers a malformed field or one missing other than `amount`, `reference` and `returnUrl`
(errorCode `000`), and an Idempotency-Key over 64 characters; the 500 of the faults
(`000`); 401 before routing and a 404 for any other path or method (there is nothing to
GET); validation refusals are not stored under the key; `fail_after` stores
the real answer (a 500 in front of a platform that processed the request) so a replay
learns it; a modification refused by the accounting rules is still "received" and fails
in its notification, with the fake's wording in `reason`.

Not implemented: 3D Secure and redirect flows (`action`, `/payments/details`),
`/sessions`, `/cancels` without a reference, `/reversals`, `/amountUpdates`, multiple
partial captures, CAPTURE_FAILED / REFUND_FAILED, basic auth on webhooks, batches of more
than one item per notification, API versions other than v72, TLS.
"""
