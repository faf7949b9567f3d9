"""The operators' desk in the admin, one module per concern.

- `mixin`: `DeskViewsMixin`, the desk's extra views mixed into OperationAdmin.
- `actions`: one action on one operation (confirmation, service, log), the bulk query.
- `attention`: the Needs attention page; `audit`: the last fence audit as tables.
- `export`: the CSV export; `queries`: the annotations and filters the lists use.
- `payment`: an order's page as its payment's; `refund`: a refund asked from it.
- `search`: a provider reference no step has, asked at the provider.
- `chart`: the outcomes per hour of Needs attention; `nothing_ran`: its cases an outage
  refused before they ran, and what it does not list of them.
- `rq_links`: links to django-rq's pages.
"""
