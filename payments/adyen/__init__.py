"""Adyen as a payment system a shop can pay through, beside the Stripe-compatible provider.

- `system`: the declaration (7 days of key retention, no reads, pspReference).
- `client`, `errors`: the Checkout client on Adyen's official library, and its error table.
- `effects`: a payment (charge, authorisation) and its modifications (capture, refund,
  cancel), settled by their answer or by their notification.
- `choice`: which system an operation pays through; the mixin the shop's effects wear.
- `models`, `notifications`, `views`: the signed notifications, stored once, settling steps.
- `checks`: the settings entry's system checks.

Configured by PAYMENTS["SYSTEMS"]["adyen"] (docs/adyen.md) and ApiClient.payment_system.
"""
