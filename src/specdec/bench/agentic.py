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

The agent-loop set (`--prompts agent-loop --per-category 20 --stream`) is two longer loops, 20
requests each: SQL over one schema (sql-loop), then one tool's calls (tool-loop).
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


# The agent loops: one artefact, 20 requests in a row (the first four of each are the suite's own).
# An agent's queries and calls repeat each other's structure (the join chain through order_items,
# the call's JSON skeleton) more than they repeat their prompt: what a cache of earlier outputs
# (suffix decoding's global tree) can draft and prompt lookup cannot.
_SQL_LOOP = _SQL_QUESTIONS + (
    "What is the average order value per country in 2023?",
    "Which customers placed more than 3 orders in 2023?",
    "What are the 10 best-selling products by quantity, with their category?",
    "What was the monthly revenue in 2023, in month order?",
    "Which customers have orders with status 'cancelled' but never one with status 'delivered'?",
    "What is the total revenue per customer country for delivered orders?",
    "For each product category, which product has the highest revenue?",
    "How many distinct customers bought something in each month of 2023?",
    "Which orders contain more than 5 different products?",
    "What is the revenue of each product in 2024 so far, highest first?",
    "Which customers signed up in 2023 but never placed an order?",
    "What share of all revenue comes from the 'electronics' category?",
    "What is the average number of items per order for each order status?",
    "Which customers from France bought products from more than 2 categories?",
    "What is the first order date and the last order date of every customer?",
    "Which 3 countries had the most delivered orders in 2023?",
)
_TOOL_LOOP = _TOOL_REQUESTS + (
    "Schedule a 15-minute stand-up on 2024-05-15 at 09:00 with dev-team@example.com, location Zoom.",
    "Put a two-hour workshop on 2024-05-22 at 13:00 with kim@example.com and omar@example.com in Room 2.",
    "Add lunch with julia@example.com on 2024-05-17 at 12:30 for one hour at Cafe Nord.",
    "Create a 90-minute planning session on 2024-05-21 at 10:00 with pm@example.com in the Studio.",
    "Book a 30-minute call with legal@example.com on 2024-05-23 at 15:00, location Phone.",
    "Set up a one-hour interview on 2024-05-24 at 11:00 with hr@example.com and cto@example.com in Room 4.",
    "I need a 20-minute check-in with sam@example.com on 2024-05-27 at 08:40 in Room 1.",
    "Add a three-hour offsite on 2024-06-05 at 09:00 with team@example.com at the Lake House.",
    "Schedule a 45-minute demo on 2024-05-28 at 16:00 with client@example.com, location Zoom.",
    "Create a one-hour retrospective on 2024-05-31 at 14:00 with dev-team@example.com in the Studio.",
    "Book a 30-minute budget review on 2024-06-04 at 10:30 with cfo@example.com in the Board Room.",
    "Put a one-hour mentoring session on 2024-06-06 at 17:00 with ana@example.com at Cafe Nord.",
    "Add a 15-minute sync on 2024-06-07 at 09:15 with raj@example.com, location Phone.",
    "Set up a two-hour training on 2024-06-10 at 13:30 with new-hires@example.com in Room 2.",
    "Schedule a one-hour vendor meeting on 2024-06-11 at 11:00 with sales@vendor.example in Room 3.",
    "I need a 50-minute yoga class on 2024-06-12 at 18:00 at the Gym, no attendees.",
)


def _tool_prompt(request: str) -> str:
    return ("You can call this tool:\n\n" + _TOOL + "\n\nReply with exactly one JSON object "
            "{\"name\": ..., \"arguments\": {...}} and nothing else.\n\nUser: " + request)


def _sql_prompt(question: str) -> str:
    return ("Database schema (PostgreSQL):\n\n" + _SCHEMA + "\n\nWrite one SQL query that answers "
            "the question. Reply with the query in a ```sql block and nothing else.\n\nQuestion: " + question)


def agent_loop_prompts() -> list[tuple[str, tuple[str, ...]]]:
    """Two agent loops of 20 requests each: SQL over one schema, then calls of one tool."""
    return ([("sql-loop", (_sql_prompt(question),)) for question in _SQL_LOOP]
            + [("tool-loop", (_tool_prompt(request),)) for request in _TOOL_LOOP])


def agentic_prompts() -> list[tuple[str, tuple[str, ...]]]:
    """(category, turns) in the order a stream runs them."""
    prompts: list[tuple[str, tuple[str, ...]]] = [("multi-edit", _EDIT_TURNS)]
    prompts += [("tool-call", (_tool_prompt(request),)) for request in _TOOL_REQUESTS]
    prompts += [("sql", (_sql_prompt(question),)) for question in _SQL_QUESTIONS]
    prompts += [("log-summary", (_LOG_FORMAT + logs,)) for logs in _LOGS]
    return prompts
