select o_custkey, sum(o_totalprice) as revenue
from {{ source('shop', 'orders') }}
group by o_custkey
having sum(o_totalprice) > 30000
