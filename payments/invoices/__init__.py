"""The invoice export: a paid order's invoice, sent once to the accounting system.

The worked example of docs/handlers.md "Adding an external system": a package that adds
a system the fence calls, built on the handler API (`payments.fence`) and touching no
shared module: its operation declares that it follows a paid order
(`Follows(ORDER_PAID)`), and its settings entry is `PAYMENTS["SYSTEMS"]["accounting"]`.

- `system`: what the fence must know of the accounting API (`declare_system`): its key
  retention, that it compares bodies under a key, that a list by `external_id` settles a
  lost answer, that it moves no money, its references (`inv_...`) and words.
- `client`: its HTTP client, built from the settings entry, with its own error table.
- `effect`: `ExportInvoice`, the one external step: its request, its lookup.
- `handler`: the `invoice_export` operation, a follow-up of a paid order.
"""
