"""The agentic suite: repetitive work of the kind agents and tools send a server, where one
request repeats much of its input and consecutive requests repeat each other. This is the
workload SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) was built for: agentic SQL,
tool calls, repeated edits.

Four categories, each a short series of requests over one shared artefact, in order (run them
with `specdec bench --prompts agentic --stream` so cross-request caches count as in a server):
  multi-edit   one Python module edited turn after turn; each turn asks for the whole file
               back (multi-turn: the model's own earlier answers are in the context)
  tool-call    one tool schema, several user requests, each answered with one JSON call
  sql          one database schema, several questions, each answered with one SQL query
  log-summary  service logs summarised into the same report layout, one log per request
"""

from __future__ import annotations

_MODULE = '''\
import csv
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    amount: float
    status: str


def load_orders(path):
    orders = []
    with open(path) as handle:
        for row in csv.DictReader(handle):
            orders.append(Order(row["order_id"], row["customer"], float(row["amount"]), row["status"]))
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        if order.status == "paid":
            totals[order.customer] = totals.get(order.customer, 0.0) + order.amount
    return totals


def top_customers(orders, count):
    totals = total_by_customer(orders)
    return sorted(totals.items(), key=lambda item: item[1], reverse=True)[:count]
'''

_EDIT_TURNS = (
    "Here is a Python module.\n\n```python\n" + _MODULE + "```\n\nAdd type hints to every function. "
    "Reply with the whole module only.",
    "Now add a docstring to every function. Reply with the whole module only.",
    "Now make `total_by_customer` also count orders whose status is \"shipped\". Reply with the whole "
    "module only.",
)

_TOOL = '''{
  "name": "create_calendar_event",
  "description": "Create an event in the user's calendar.",
  "parameters": {
    "type": "object",
    "properties": {
      "title": {"type": "string"},
      "date": {"type": "string", "description": "YYYY-MM-DD"},
      "start_time": {"type": "string", "description": "HH:MM, 24-hour"},
      "duration_minutes": {"type": "integer"},
      "attendees": {"type": "array", "items": {"type": "string", "description": "email address"}},
      "location": {"type": "string"}
    },
    "required": ["title", "date", "start_time", "duration_minutes"]
  }
}'''

_TOOL_REQUESTS = (
    "Set up a 30-minute sync with anna@example.com and raj@example.com on 2024-05-14 at 09:30 in Room 4.",
    "Book the quarterly review for 2024-06-03 from 14:00 to 15:30 with cfo@example.com, location Board Room.",
    "I need a one-hour dentist appointment on 2024-05-20 at 16:15 at Smile Clinic, no attendees.",
    "Add a 45-minute design critique on 2024-05-16 at 11:00 with lena@example.com, tom@example.com and "
    "mia@example.com in the Studio.",
)

_SCHEMA = '''CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, country TEXT, signup_date DATE);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price NUMERIC);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                     order_date DATE, status TEXT);
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), product_id INTEGER REFERENCES products(id),
                          quantity INTEGER);'''

_SQL_QUESTIONS = (
    "What is the total revenue per product category in 2023, highest first?",
    "Which 5 customers from Germany spent the most on delivered orders?",
    "How many orders did each customer place in their first 30 days after signing up?",
    "Which products were never ordered?",
)

_LOGS = (
    "2024-05-02T10:00:01Z INFO api request_id=a1 GET /orders 200 41ms\n"
    "2024-05-02T10:00:02Z INFO api request_id=a2 GET /orders/17 200 38ms\n"
    "2024-05-02T10:00:04Z WARN db slow query 1200ms: SELECT * FROM orders WHERE customer_id=17\n"
    "2024-05-02T10:00:05Z ERROR api request_id=a3 POST /orders 500 1502ms: database timeout\n"
    "2024-05-02T10:00:07Z INFO api request_id=a4 GET /orders 200 45ms\n"
    "2024-05-02T10:00:09Z ERROR api request_id=a5 POST /orders 500 1498ms: database timeout\n"
    "2024-05-02T10:00:12Z INFO db connection pool resized from 20 to 40\n"
    "2024-05-02T10:00:15Z INFO api request_id=a6 POST /orders 201 88ms\n",
    "2024-05-02T11:20:00Z INFO auth request_id=b1 POST /login 200 120ms\n"
    "2024-05-02T11:20:03Z WARN auth request_id=b2 POST /login 401 95ms: invalid password for user 311\n"
    "2024-05-02T11:20:04Z WARN auth request_id=b3 POST /login 401 97ms: invalid password for user 311\n"
    "2024-05-02T11:20:05Z WARN auth request_id=b4 POST /login 401 94ms: invalid password for user 311\n"
    "2024-05-02T11:20:06Z ERROR auth account 311 locked after 3 failed attempts\n"
    "2024-05-02T11:21:10Z INFO auth request_id=b5 POST /login 200 118ms\n"
    "2024-05-02T11:22:00Z INFO auth request_id=b6 POST /password-reset 202 64ms\n",
    "2024-05-02T13:05:00Z INFO worker job=invoice-batch started, 1200 invoices\n"
    "2024-05-02T13:06:30Z WARN worker job=invoice-batch invoice 884 skipped: missing tax id\n"
    "2024-05-02T13:07:45Z WARN worker job=invoice-batch invoice 1021 skipped: missing tax id\n"
    "2024-05-02T13:09:10Z INFO worker job=invoice-batch 1198 invoices sent\n"
    "2024-05-02T13:09:11Z INFO worker job=invoice-batch finished in 251s\n"
    "2024-05-02T13:10:00Z ERROR mailer smtp connection refused by mail.example.com:587, retrying in 60s\n"
    "2024-05-02T13:11:00Z INFO mailer smtp connection restored\n",
)

_LOG_FORMAT = ("Summarise these service logs as a report with exactly these sections:\n"
               "## Summary\n## Errors\n## Warnings\n## Suggested actions\n"
               "Use one bullet per finding and quote the request ids or job names.\n\nLogs:\n")


def agentic_prompts() -> list[tuple[str, tuple[str, ...]]]:
    """(category, turns) in the order a stream runs them."""
    prompts: list[tuple[str, tuple[str, ...]]] = [("multi-edit", _EDIT_TURNS)]
    prompts += [("tool-call", ("You can call this tool:\n\n" + _TOOL + "\n\nReply with exactly one JSON object "
                               "{\"name\": ..., \"arguments\": {...}} and nothing else.\n\nUser: " + request,))
                for request in _TOOL_REQUESTS]
    prompts += [("sql", ("Database schema (PostgreSQL):\n\n" + _SCHEMA + "\n\nWrite one SQL query that answers "
                         "the question. Reply with the query in a ```sql block and nothing else.\n\nQuestion: "
                         + question,)) for question in _SQL_QUESTIONS]
    prompts += [("log-summary", (_LOG_FORMAT + logs,)) for logs in _LOGS]
    return prompts
