select o.o_custkey, o.o_totalprice
from {{ source('shop', 'orders') }} o
where o.o_status = 'O' and o.o_totalprice > 500
