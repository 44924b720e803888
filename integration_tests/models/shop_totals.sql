select count(*) as n_orders, sum(o_totalprice) as revenue, max(o_totalprice) as max_price
from {{ source('shop', 'orders') }}
