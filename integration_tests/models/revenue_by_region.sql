select c_region, sum(revenue) as revenue, sum(n_orders) as n_orders, count(*) as n_customers
from {{ ref('revenue_by_customer') }}
group by c_region
