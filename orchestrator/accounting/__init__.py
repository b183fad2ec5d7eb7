"""What a run costs and how it went: the bill, alerts, exporters, the report and prices."""
